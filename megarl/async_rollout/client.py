"""The training ranks' side of separate placement: `RemoteRollout` talks to this rank's rollout
server (megarl.async_rollout.server); `AsyncSchedule` keeps requests up to async.max_staleness
steps ahead of the trainer and enforces the bound.

Prompts: each training rank sends its share of its DP batch (cut over its model-parallel group, as
the colocated dispatch does) to its own server, and the model-parallel group all-gathers the
results: no rank holds the step's batch twice. Seeds are (seed, step, prompt, sample) as in every
engine, so a sample does not depend on placement: at K = 0 a run logs what colocated logs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from megarl.async_rollout.wire import recv_object, send_object
from megarl.async_rollout.staleness import StalenessStats, split_fresh, trained_version
from megarl.hybrid.dispatch import share_bounds
from megarl.platform.process_groups import all_gather_object
from megarl.rollout.base import RolloutRequest, RolloutResult, SamplingParams
from megarl.rollout.multi_turn import env_rows


class RemoteRollout:
    """This training rank's rollout server seen as a rollout engine: `load_weights` (what
    HybridEngine.hand_over calls: rank 0 announces the version, every rank sends its part of the
    stream), `submit` / `collect` (prompts out, results back), `generate` (both, waiting)."""

    record_routes = False  # no routing replay from separate rollout ranks (validation refuses it)

    def __init__(self, groups, rank: int):
        self.groups, self.rank = groups, rank
        self.placement = groups.placement
        self.server = self.placement.server_of(rank)
        self.version = -1  # the newest weights version pushed to the rollout ranks
        self.pushing = 0  # the version the next load_weights pushes
        self._next_id = 0
        self._results: dict[int, list[RolloutResult]] = {}
        self.server_info: dict = {}  # the server's last report: sync bytes, busy and wall seconds
        self.wait_s = 0.0  # time this rank spent waiting for results
        # rollout.multi_turn (set by megarl.rollout.multi_turn.with_environment): the server runs the
        # episodes, so each request goes with its prompt's row (what Environment.reset reads)
        self.multi_turn, self.chat = False, None
        self.rows: dict[int, dict] = {}  # global prompt index -> row, set before generate (as MultiTurnRollout.rows)

    remote_episodes = True  # with_environment: episodes run on the rollout rank, not around this handle

    def begin_push(self, version: int) -> None:
        """The policy version the next load_weights pushes (the step before the one it serves)."""
        self.pushing = version

    def use_rows(self, rows: dict[int, dict]) -> None:
        """The rows of the next generate's prompts (multi-turn: the rollout rank's episodes read them)."""
        self.rows = rows

    # --- the RolloutEngine calls HybridEngine.hand_over makes -------------------------------------
    def load_weights(self, stream) -> None:
        if self.rank == 0:
            for r in self.placement.rollout_ranks:
                send_object(("weights", self.pushing), r, self.groups.ctrl)
        for _ in stream:  # this rank's sends of the shared plan; a training rank loads nothing
            pass
        self.version = self.pushing

    def resume_memory(self) -> None:
        pass

    def release_memory(self) -> None:
        pass

    # --- prompts and results ----------------------------------------------------------------------
    def submit(self, requests: list[RolloutRequest], sampling: SamplingParams, floor: int, rows: dict | None = None) -> int:
        """rows: {prompt index: row} of the requests' prompts (multi-turn; default: self.rows)."""
        request_id, self._next_id = self._next_id, self._next_id + 1
        if self.multi_turn:
            rows = rows if rows is not None else self.rows
            rows = {r.prompt_index: rows[r.prompt_index] for r in requests}
        else:
            rows = None
        send_object(("generate", self.rank, request_id, list(requests), sampling, floor, rows), self.server, self.groups.ctrl)
        return request_id

    def collect(self, request_id: int) -> list[RolloutResult]:
        start = time.perf_counter()
        while request_id not in self._results:  # results come back in the server's order
            _, rid, results, info = recv_object(self.server, self.groups.up)
            self._results[rid], self.server_info = results, info
        self.wait_s += time.perf_counter() - start
        return self._results.pop(request_id)

    def generate(self, requests, sampling: SamplingParams) -> list[RolloutResult]:
        return self.collect(self.submit(list(requests), sampling, self.version))

    def stop(self) -> None:
        if self.rank == 0:
            for r in self.placement.rollout_ranks:
                send_object(("stop",), r, self.groups.ctrl)

    def close(self) -> None:
        self.stop()


@dataclass
class _InFlight:
    prompts: list  # this DP rank's PromptRows of the step
    request_id: int | None  # None: not submitted (restored from a checkpoint)
    floor: int


@dataclass
class AsyncSchedule:
    """Requests for steps s .. s+K in flight while step s trains (K = async.max_staleness).

    Step t's prompts are submitted at step t - K with the newest weights then (version t-K-1), so
    no sample is older than K when trained; a sample that is anyway (weights lagging, a resume) is
    dropped with its prompt group and generated again under the current weights (counted)."""

    remote: RemoteRollout
    dispatch: object  # DispatchGroups: this rank's model-parallel group
    max_staleness: int
    total_steps: int
    in_flight: dict[int, _InFlight] = field(default_factory=dict)
    data_states: dict[int, dict] = field(default_factory=dict)

    def _submit(self, prompts, step: int, sampling: SamplingParams, floor: int) -> int:
        d = self.dispatch
        lo, hi = share_bounds(len(prompts), d.mp_size, d.mp_rank)
        requests = [RolloutRequest(tuple(p.prompt_ids), prompt_index=p.global_index, step=step) for p in prompts[lo:hi]]
        if getattr(self.remote, "multi_turn", False):  # the rollout rank runs episodes: their prompts' rows too
            return self.remote.submit(requests, sampling, floor, env_rows(prompts[lo:hi]))
        return self.remote.submit(requests, sampling, floor)

    def _collect(self, request_id: int) -> list[RolloutResult]:
        d = self.dispatch
        mine = self.remote.collect(request_id)
        return [r for part in all_gather_object(mine, d.mp_size, d.mp_group) for r in part]

    def prefetch(self, step: int, next_prompts, sampling: SamplingParams, data_state=None) -> None:
        """Submit every step up to step + K not yet in flight (prompts in data order). data_state:
        the dataset's position, recorded before each step's prompts are drawn (checkpoints)."""
        for t in range(step, min(step + self.max_staleness, self.total_steps) + 1):
            if t not in self.in_flight:
                if data_state is not None:
                    self.data_states[t] = data_state()
                self.in_flight[t] = _InFlight(next_prompts(), None, trained_version(step))
            flight = self.in_flight[t]
            if flight.request_id is None:
                flight.request_id = self._submit(flight.prompts, t, sampling, max(flight.floor, self.remote.version))

    def take(self, step: int, sampling: SamplingParams, to_samples):
        """Step `step`'s samples, none older than K, and the step's `async/` statistics (this rank's)."""
        flight = self.in_flight.pop(step)
        self.data_states.pop(step, None)
        samples = to_samples(flight.prompts, self._collect(flight.request_id), sampling)
        stats = StalenessStats()
        _, dropped = split_fresh(samples, step, self.max_staleness)
        if dropped:  # the whole prompt group again, under the weights the trainer has now
            groups = sorted({s.prompt_index for s in dropped})
            stats.dropped = sum(1 for s in samples if s.prompt_index in groups)
            again = [p for p in flight.prompts if p.global_index in groups]
            fresh = to_samples(again, self._collect(self._submit(again, step, sampling, trained_version(step))), sampling)
            by_key = {(s.prompt_index, s.sample_index): s for s in fresh}
            samples = [by_key.get((s.prompt_index, s.sample_index), s) for s in samples]
        for s in samples:
            if s.versions:
                stats.add(step, s.versions)
        return samples, stats

    # --- checkpoint -------------------------------------------------------------------------------
    def data_state(self, current: dict) -> dict:
        """The dataset position a checkpoint records: before the prompts of the first step in
        flight. A resume draws those steps' prompts again, in the same order, and generates them
        under the resumed weights: no prompt is lost or trained twice. (The dataset's position is
        the same on every rank, so this holds for every DP rank's share.)"""
        return self.data_states[min(self.in_flight)] if self.in_flight else current
