"""Preemption: SIGTERM / SIGUSR1 end a run at a step boundary with one checkpoint, on every rank alike.

Slurm sends SIGTERM before it kills a job at its wall time or on preemption (and `--signal=USR1@120`
style options deliver a signal early); torchrun forwards SIGTERM to its workers and waits
`--shutdown_timeout` seconds before SIGKILL. The handler only sets a flag: the step in flight (or a
checkpoint being written) runs to its end, so a signal never leaves a half-written checkpoint behind.
At each step boundary every rank takes part in one tiny all-reduce (MAX) of its flag, so all ranks
agree on the same step even when the signal reached them at different times; they then write one
checkpoint (unless this step's is already written) and exit with PREEMPTED_EXIT_CODE. The requeued
job resumes from that checkpoint (trainer.resume=auto) and continues as if never stopped.
"""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from megarl.distributed.parallel import all_reduce_host

# EX_TEMPFAIL from sysexits.h: "temporary failure, try again" - the run is resumable as it stands.
PREEMPTED_EXIT_CODE = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """Raised by Trainer.train after the preemption checkpoint; the process exits PREEMPTED_EXIT_CODE."""

    def __init__(self, step: int, signame: str):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step, self.signame = step, signame


_installed: "PreemptionWatch | None" = None


def installed_watch() -> "PreemptionWatch | None":
    """The watch megarl.run.Run installed around the training loop (None outside it). A wait that can
    outlast a preemption's grace period (the fleet's wait for rollout servers) looks at it to stop
    before the step boundary."""
    return _installed


class PreemptionWatch:
    """Remembers the first SIGTERM / SIGUSR1 this process receives; `agreed()` is the collective check."""

    def __init__(self):
        self.received: int | None = None
        self.keep_until_exit = False  # set when stopping for a signal: uninstall() then leaves the handlers
        self._previous = {}

    def install(self) -> "PreemptionWatch":
        global _installed
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        _installed = self
        return self

    def uninstall(self) -> None:
        global _installed
        _installed = None
        if self.keep_until_exit:
            # Stopping for a signal: ignore further ones (torchrun SIGTERMs the other ranks as soon as one
            # exits). SIG_IGN, not our handler: Python resets its own handlers to the default at shutdown.
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:  # async-signal context: only set the flag
        if self.received is None:
            self.received = signum

    def agreed(self, group=None) -> str | None:
        """Collective over `group` (default: the world): the signal's name when any rank received one, else None.
        Every rank gets the same answer, so all stop after the same step."""
        flag = torch.tensor([self.received or 0], dtype=torch.int64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            flag = all_reduce_host(flag, group, op=dist.ReduceOp.MAX)
        signum = int(flag.item())
        return signal.Signals(signum).name if signum else None
