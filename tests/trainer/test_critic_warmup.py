"""trainer.critic_warmup as verl applies it: `critic_warmup <= step`, steps counted from 1."""
from __future__ import annotations

import pytest

from megarl.step.updates import actor_updates_at


@pytest.mark.parametrize("warmup, first_actor_step", [(0, 1), (1, 1), (2, 2), (5, 5)])
def test_actor_first_updates_at_the_warmup_step(warmup, first_actor_step):
    updated = [step for step in range(1, 9) if actor_updates_at(step, warmup)]
    assert updated == list(range(first_actor_step, 9))
