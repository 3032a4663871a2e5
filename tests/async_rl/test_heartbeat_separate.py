"""The heartbeat under separate placement: a rollout rank runs another program (its phases do not
line up with the trainer's), so it is judged apart: named when it is silent, or when a training
rank has waited for samples for the timeout while the rollout rank sat in one request as long."""
from __future__ import annotations

from megarl.heartbeat import Heartbeat


class _DictStore:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


def test_a_rollout_rank_stuck_in_a_request_is_named():
    beat = Heartbeat(_DictStore(), rank=0, world_size=2, timeout_s=10, rollout_ranks=(1,))
    beat.enter("timing_s/gen", step=4)  # the trainer waits for samples
    t0 = beat.phase_since
    stuck = {1: {"beat": 1, "phase": "generate", "step": 0, "seq": 7}}
    for i in range(10):  # beats keep coming (the thread lives) but the request never ends
        assert beat.check({1: {**stuck[1], "beat": i}}, t0 + i, started=t0) is None
    message = beat.check({1: {**stuck[1], "beat": 11}}, t0 + 11, started=t0)
    assert message is not None and "stalled: rank 1 (last in phase 'generate'" in message and "phase 'generate' of step 4" in message


def test_a_busy_rollout_rank_and_a_training_rank_ahead_are_not_a_stall():
    beat = Heartbeat(_DictStore(), rank=0, world_size=2, timeout_s=10, rollout_ranks=(1,))
    beat.enter("timing_s/gen", step=4)
    t0 = beat.phase_since
    for i in range(30):  # request after request: its seq moves, whatever the trainer's seq is
        assert beat.check({1: {"beat": i, "phase": "generate" if i % 2 else "wait", "step": 0, "seq": i}}, t0 + i, started=t0) is None
    beat.enter("timing_s/update_actor", step=4)  # training long while the rollout rank waits: normal
    t1 = beat.phase_since
    for i in range(30):
        assert beat.check({1: {"beat": 100 + i, "phase": "wait", "step": 0, "seq": 30}}, t1 + i, started=t0) is None


def test_a_silent_rollout_rank_is_named():
    beat = Heartbeat(_DictStore(), rank=0, world_size=2, timeout_s=10, rollout_ranks=(1,))
    t0 = beat.phase_since
    record = {1: {"beat": 3, "phase": "wait", "step": 0, "seq": 2}}
    assert beat.check(record, t0 + 1, started=t0) is None
    message = beat.check(record, t0 + 12, started=t0)
    assert message is not None and "silent" in message and "rank 1 (last in phase 'wait'" in message
