"""Hangs that explain themselves: a per-rank heartbeat and a watchdog with trainer.collective_timeout_s.

Every rank publishes, from a background thread, a record in the process group's key-value store (the
torchrun / c10d store every rank already reaches): a beat counter, and the phase its main thread is in
(sync, generate, forward, reward, advantages, update, save, ...) with the phase's sequence number. The
ranks run the same program, so the sequence numbers line up. The same thread watches the other ranks:

  * a rank whose beat counter has not moved for collective_timeout_s is *silent* (frozen, killed,
    swapping, its node gone);
  * when this rank has been in one phase for collective_timeout_s and some ranks are at an earlier
    phase, those ranks are *stalled* (this rank waits for them in a collective).

Either way the watchdog prints one line naming the rank(s) and the phase each was last in, and ends
the process with STALL_EXIT_CODE; torchrun then stops the other ranks. Ranks that all sit in the same
long phase are not a hang that a rank can be blamed for, and are left alone (a slow generate is slow,
not stuck). Clocks are never compared across machines: only local time since a value last changed.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

STALL_EXIT_CODE = 70  # EX_SOFTWARE from sysexits.h
# timing names of Trainer.ppo_step -> the phases the messages use
_PHASES = {"gen": "generate", "old_log_prob": "forward", "ref": "forward", "values": "forward", "adv": "advantages",
           "update_critic": "update", "update_actor": "update"}
_current: "Heartbeat | None" = None


def enter(name: str, step: int | None = None) -> None:
    """The main thread enters phase `name` (a Trainer timing name like 'timing_s/gen' is mapped), of
    step `step` when given; a no-op when no heartbeat runs (single process, tests of parts)."""
    if _current is not None:
        _current.enter(name, step)


class Heartbeat:
    def __init__(self, store, rank: int, world_size: int, timeout_s: float, interval_s: float | None = None,
                 on_stall=None, prefix: str = "megarl/heartbeat/", rollout_ranks: tuple[int, ...] = ()):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, float(timeout_s)
        # separate placement (megarl.async_rollout.placement): ranks that run the rollout server, another program
        # whose phases do not line up with the trainer's; a training rank waiting in 'generate'
        # names one stuck in its own 'generate' (its phase unchanged for the timeout) as stalled
        self.rollout_ranks = tuple(rollout_ranks)
        self._phase_seen: dict[int, tuple[object, float]] = {}
        self.interval_s = interval_s if interval_s is not None else min(10.0, max(0.5, self.timeout_s / 10))
        self.prefix = prefix
        self.on_stall = on_stall or _exit_with
        self.phase, self.step, self.seq = "start", 0, 0
        self.phase_since = time.monotonic()
        self._stop = threading.Event()
        self._seen: dict[int, tuple[object, float]] = {}  # rank -> (its last beat, local time it changed)
        self._thread = threading.Thread(target=self._run, name="megarl-heartbeat", daemon=True)

    # --- main thread ----------------------------------------------------------------------------
    def enter(self, name: str, step: int | None = None) -> None:
        name = name.removeprefix("timing_s/")
        self.phase, self.seq, self.phase_since = _PHASES.get(name, name), self.seq + 1, time.monotonic()
        if step is not None:
            self.step = step

    def start(self) -> "Heartbeat":
        global _current
        _current = self
        self._thread.start()
        return self

    def stop(self) -> None:
        """Publish 'finished' (others stop watching this rank) and end the thread."""
        global _current
        if _current is self:
            _current = None
        self._stop.set()
        self._thread.join(timeout=self.interval_s * 3)
        try:
            self._publish(beat="finished")
        except Exception:  # the store may be gone at shutdown; nothing waits on this rank any more
            pass

    # --- the heartbeat thread -------------------------------------------------------------------
    def _publish(self, beat) -> None:
        record = {"beat": beat, "phase": self.phase, "step": self.step, "seq": self.seq}
        self.store.set(f"{self.prefix}{self.rank}", json.dumps(record))

    def _read(self) -> dict[int, dict]:
        records = {}
        for rank in range(self.world_size):
            key = f"{self.prefix}{rank}"
            if rank != self.rank and self.store.check([key]):
                records[rank] = json.loads(self.store.get(key))
        return records

    def _run(self) -> None:
        beat, started = 0, time.monotonic()
        try:  # at once: a rank that freezes within its first interval is still named with its phase
            self._publish(beat)
        except Exception:
            pass
        while not self._stop.wait(self.interval_s):
            beat += 1
            try:
                self._publish(beat)
                records = self._read()
            except Exception:  # store unreachable: the process group is failing anyway, and says so
                continue
            message = self.check(records, time.monotonic(), started)
            if message is not None:
                self.on_stall(message)
                return

    def check(self, records: dict[int, dict], now: float, started: float) -> str | None:
        """The one-line verdict on the other ranks' records, or None while nothing is stuck."""
        silent, behind = [], []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            record = records.get(rank)
            if record is not None and record["beat"] == "finished":
                continue
            beat = None if record is None else record["beat"]
            last, since = self._seen.get(rank, (object(), now))
            if beat != last:
                self._seen[rank] = (beat, now)
                since = now
            quiet_s = now - max(since, started)
            if quiet_s >= self.timeout_s:
                silent.append((rank, record, None))
            elif rank in self.rollout_ranks:
                if record is not None and self._rollout_stalled(rank, record, now):
                    behind.append((rank, record, None))
            elif record is not None and record["seq"] < self.seq and now - self.phase_since >= self.timeout_s:
                # a process that froze shortly before the timeout is both: say so
                behind.append((rank, record, quiet_s if quiet_s >= 3 * self.interval_s else None))
        if not silent and not behind:
            return None
        parts = []
        if silent:
            parts.append("silent (no heartbeat for {:.0f} s): {}".format(self.timeout_s, ", ".join(map(_describe, silent))))
        if behind:
            parts.append("stalled: " + ", ".join(map(_describe, behind)))
        return (f"megarl: rank {self.rank} waited {now - self.phase_since:.0f} s in phase '{self.phase}' of step "
                f"{self.step} (trainer.collective_timeout_s={self.timeout_s:g}); " + "; ".join(parts))


    def _rollout_stalled(self, rank: int, record: dict, now: float) -> bool:
        """A rollout rank stuck in one request while this rank has waited for samples as long."""
        phase = (record["phase"], record["seq"])
        last, since = self._phase_seen.get(rank, (None, now))
        if phase != last:
            self._phase_seen[rank] = (phase, now)
            since = now
        return (self.rank not in self.rollout_ranks and self.phase == "generate" and record["phase"] == "generate"
                and now - self.phase_since >= self.timeout_s and now - since >= self.timeout_s)


def _describe(item) -> str:
    rank, record, quiet_s = item
    if record is None:
        return f"rank {rank} (never reported)"
    frozen = "" if quiet_s is None else f", its heartbeat stopped {quiet_s:.0f} s ago"
    return f"rank {rank} (last in phase '{record['phase']}' of step {record['step']}{frozen})"


def _exit_with(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(STALL_EXIT_CODE)


def start_for_world(timeout_s: float, rank: int, world_size: int, separate=None) -> Heartbeat | None:
    """The heartbeat of this rank on the default process group's store; None for a single process.
    separate: the world split of separate placement (megarl.async_rollout.placement.WorldGroups): every rank of
    the whole world, rollout ranks included, beats in the world's store."""
    # deferred: torch; megarl.run imports this module and stays torch-free
    import torch.distributed as dist

    from megarl.platform import process_groups

    if separate is not None:
        placement = separate.placement
        return Heartbeat(process_groups.group_store(separate.world), rank, placement.world_size, timeout_s,
                         rollout_ranks=placement.rollout_ranks).start()
    if world_size <= 1 or not dist.is_initialized():
        return None
    return Heartbeat(process_groups.default_store(), rank, world_size, timeout_s).start()
