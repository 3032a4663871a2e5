"""The trainer's weight-sync check at GPU scale (issue 22 item 5, audit F7): the first sync of a run
fails hard over the limit (layout and name-mapping bugs); later syncs fire guard/weight_sync, log,
and go on; rollout.verify_weights_mean_atol sets the limit."""
from __future__ import annotations

import types

import pytest
import torch

from megarl.config import load_config
from megarl.hybrid.verify import WeightSyncMismatch
from megarl.step.samples import RolloutBatch


def sync_check(*overrides: str):
    """(the trainer's weight-sync check on a one-rank layout (dp 1: the DP reduction is local), no
    models; the list its log lines go to)."""
    from megarl.hybrid.sync_check import WeightSyncCheck
    from megarl.step.global_batch import GlobalBatch

    cfg = load_config(None, ["model.path=unused", "data.train_files=[unused]", "model.dtype=bfloat16", "rollout.engine=vllm", *overrides])
    lines: list[str] = []
    check = WeightSyncCheck(cfg.rollout, cfg.model.dtype, "llama", GlobalBatch(types.SimpleNamespace(dp=1, rank=0)),
                            lines.append, rank=0)
    return check, lines


def rollout(gap: float) -> tuple[RolloutBatch, torch.Tensor, torch.Tensor]:
    """Engine log-probs `gap` away from the actor's on every response token; [2, 4]."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    actor = torch.full((2, 4), -1.0)
    batch = RolloutBatch(samples=[], batch=None, rollout_logprobs=actor + gap * mask, logprobs_are_scaled=True,
                         group_ids=torch.tensor([0, 0]))
    return batch, actor, mask


def test_first_sync_over_the_limit_raises():
    check, _ = sync_check()
    with pytest.raises(WeightSyncMismatch, match=r"rollout.engine=vllm \(llama model\).*mean 0\.1.*mean <= 0\.07.*first sync"):
        check(1, *rollout(0.1))


def test_later_sync_over_the_limit_fires_the_guard_and_goes_on():
    check, lines = sync_check()
    first = check(1, *rollout(0.03))  # passes: metrics, no event
    assert first.events == [] and first.metrics["training/sync_logprob_diff_mean"] == pytest.approx(0.03)
    later = check(2, *rollout(0.1))  # would have raised on the first sync
    (name, fields), = later.events
    assert name == "guard/weight_sync" and fields["mean_limit"] == 0.07
    assert fields["training/sync_logprob_diff_mean"] == pytest.approx(0.1)
    assert later.metrics["training/sync_logprob_diff_p99"] == pytest.approx(0.1)
    assert len(lines) == 1 and "step 2: guard/weight_sync" in lines[0]


def test_mean_limit_knob():
    check, _ = sync_check("rollout.verify_weights_mean_atol=0.2")
    assert check(1, *rollout(0.1)).events == []  # first sync, under 0.2
    (name, fields), = check(2, *rollout(0.25)).events
    assert name == "guard/weight_sync" and fields["mean_limit"] == 0.2
    with pytest.raises(WeightSyncMismatch, match=r"mean <= 0\.01"):
        sync_check("rollout.verify_weights_mean_atol=0.01")[0](1, *rollout(0.03))
