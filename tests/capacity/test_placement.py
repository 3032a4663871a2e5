"""The planner's placement estimate (megarl.capacity.placement), hand-worked."""
from __future__ import annotations

import pytest

from megarl.capacity.placement import best_split, placement_times

# colocated on 4 GPUs: sync 1 s, generation 6 s, training 1 + 3 = 4 s -> 11 s per step
PHASES = {"sync": 1.0, "gen": 6.0, "old_log_prob": 1.0, "update_actor": 3.0, "total": 11.0, "sync_share": 0.09}


def test_two_rollout_gpus_of_four_hand_worked():
    t = placement_times(PHASES, gpus=4, rollout_gpus=2, model_bytes=8e9, rollout_tp=1, link_bytes_per_s=8e9)
    # generation on half the GPUs: 12 s; training on the other half: 8 s; each rollout GPU gets the model: 1 s
    assert (t["separate_gen_s"], t["separate_train_s"], t["separate_sync_stream_s"]) == (12.0, 8.0, 1.0)
    assert t["colocated_sync_s"] == 11.0 and t["separate_sync_s"] == 21.0 and t["separate_async_s"] == 12.0
    assert t["separate_async_over_separate_sync"] == pytest.approx(1.75) and t["separate_async_over_colocated_sync"] == pytest.approx(0.917)
    assert t["idle_fraction"]["separate_async"] == {"rollout": 0.0, "train": 0.25}
    assert t["idle_fraction"]["separate_sync"] == {"rollout": pytest.approx(1 - 12 / 21, abs=1e-4), "train": pytest.approx(1 - 9 / 21, abs=1e-4)}
    assert placement_times(PHASES, 4, 2, 8e9, 1, 8e9, max_staleness=0)["separate_async_s"] == 21.0  # K = 0 is synchronous


def test_best_split_balances_the_groups():
    # 3 of 4 GPUs generating: 8 s, training on 1: 16 + 1 s; 1 generating: 24 s; 2: 12 s (the best)
    assert best_split(PHASES, gpus=4, model_bytes=8e9, rollout_tp=1, link_bytes_per_s=8e9)["rollout_gpus"] == 2
    with pytest.raises(ValueError, match="multiple of --rollout-tp"):
        placement_times(PHASES, 4, 3, 8e9, 2, 8e9)
    with pytest.raises(ValueError, match="between 1 and 3"):
        placement_times(PHASES, 4, 4, 8e9, 1, 8e9)
