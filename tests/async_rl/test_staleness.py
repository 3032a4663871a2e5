"""Bounded staleness: hand-worked versions, the drop rule, the async/ metrics, and the schedule's
prefetch / drop / refill with a fake rollout server (FakeRemote: returns results stamped with the
versions a real server would have had, no processes)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from megarl.async_rollout.client import AsyncSchedule
from megarl.async_rollout.staleness import StalenessStats, is_fresh, split_fresh, staleness
from megarl.hybrid.dispatch import DispatchGroups
from megarl.rollout.base import RolloutResult, SamplingParams
from megarl.step.samples import Sample


def test_staleness_hand_worked():
    # step 5 trains version 4; a token of version 2 is 2 updates behind
    assert staleness(5, 2) == 2 and staleness(1, 0) == 0
    assert is_fresh(5, 3, 1) and not is_fresh(5, 2, 1) and is_fresh(5, 2, 2)


@dataclass
class _Row:
    global_index: int
    prompt_ids: tuple = (5, 6)


def _sample(prompt, j, versions):
    return Sample(prompt, j, [1] * len(versions), [0.0] * len(versions), True, "", versions=tuple(versions))


def test_split_and_metrics_count_from_the_oldest_token():
    p = _Row(0)
    fresh, old, spanning = _sample(p, 0, [3, 3]), _sample(p, 1, [1, 2]), _sample(p, 2, [2, 3])
    kept, dropped = split_fresh([fresh, old, spanning], step=4, max_staleness=1)  # step 4 trains version 3
    assert kept == [fresh, spanning] and dropped == [old]
    stats = StalenessStats()
    for s in kept:
        stats.add(4, s.versions)
    m = stats.metrics()
    assert m["async/staleness_mean"] == pytest.approx(0.5) and m["async/staleness_max"] == 1
    assert m["async/partial_fraction"] == pytest.approx(0.5)


class FakeRemote:
    """Models RolloutServer's contract: a request is generated under the newest weights pushed
    (never below its floor), unless `lag` holds the server back to an older version."""

    def __init__(self):
        self.version, self.lag, self.submitted, self._out, self.wait_s, self.server_info = 0, None, [], {}, 0.0, {}

    def submit(self, requests, sampling, floor):
        rid = len(self.submitted)
        used = self.version if self.lag is None else self.lag
        self.submitted.append((tuple(r.step for r in requests), floor, used))
        self._out[rid] = [RolloutResult(r.prompt_index, j, [7, 8], [-0.1, -0.2], "length", versions=[used, used])
                          for r in requests for j in range(sampling.n)]
        return rid

    def collect(self, rid):
        return self._out.pop(rid)


def _to_samples(prompts, results, sampling):
    by = {p.global_index: p for p in prompts}
    return [Sample(by[r.prompt_index], r.sample_index, r.response_token_ids, r.logprobs, True, "", versions=tuple(r.versions))
            for r in results]


def test_schedule_keeps_k_steps_in_flight_and_refills_stale_groups():
    remote = FakeRemote()
    groups = DispatchGroups(None, 0, 1, None, 0, 1)
    sched = AsyncSchedule(remote, groups, max_staleness=1, total_steps=3)
    counter = iter(range(100))
    next_prompts = lambda: [_Row(next(counter)), _Row(next(counter))]  # noqa: E731
    sampling = SamplingParams(n=2)
    sched.prefetch(1, next_prompts, sampling)
    assert sorted(sched.in_flight) == [1, 2]  # steps 1 and 2 requested under version 0
    samples, stats = sched.take(1, sampling, _to_samples)
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1] and stats.staleness_max == 0 and stats.dropped == 0
    remote.version, remote.lag = 1, 0  # the server lags: step 3's prompts still come back as version 0
    sched.prefetch(2, next_prompts, sampling)
    assert sorted(sched.in_flight) == [2, 3] and remote.submitted[-1][:2] == ((3, 3), 1)  # floor 1 asked
    samples, stats = sched.take(2, sampling, _to_samples)  # version 0 at step 2: staleness 1 = K, kept
    assert stats.staleness_max == 1 and stats.dropped == 0
    remote.version, remote.lag = 2, None
    samples, stats = sched.take(3, sampling, _to_samples)  # version 0 at step 3: staleness 2 > K: refilled
    assert stats.dropped == 4 and stats.staleness_max == 0
    assert all(s.versions == (2, 2) for s in samples) and [s.prompt_index for s in samples] == [4, 4, 5, 5]
    assert remote.submitted[-1][:2] == ((3, 3), 2)  # the same prompts, same step (same seeds), floor 2


def test_checkpoint_data_position_is_before_the_steps_in_flight():
    remote = FakeRemote()
    sched = AsyncSchedule(remote, DispatchGroups(None, 0, 1, None, 0, 1), max_staleness=2, total_steps=10)
    position = {"drawn": 0}

    def next_prompts():
        position["drawn"] += 1
        return [_Row(position["drawn"] - 1)]

    sched.prefetch(1, next_prompts, SamplingParams(), data_state=lambda: dict(position))
    sched.take(1, SamplingParams(), _to_samples)
    assert position == {"drawn": 3} and sorted(sched.in_flight) == [2, 3]
    # a checkpoint after step 1 resumes drawing at step 2's prompts: steps 2 and 3 are drawn again
    assert sched.data_state(dict(position)) == {"drawn": 1}
    sched.prefetch(2, next_prompts, SamplingParams(), data_state=lambda: dict(position))
    sched.take(2, SamplingParams(), _to_samples)
    sched.take(3, SamplingParams(), _to_samples)
    assert sorted(sched.in_flight) == [4] and sched.data_state(dict(position)) == {"drawn": 3}
    sched.take(4, SamplingParams(), _to_samples)
    assert sched.data_state(dict(position)) == dict(position)  # nothing in flight: the dataset's own position
