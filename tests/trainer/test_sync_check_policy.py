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


def bare_trainer(*overrides: str):
    """Trainer's check methods on a one-rank layout (dp 1: the DP reduction is local), no models."""
    from megarl.step.global_batch import GlobalBatch
    from megarl.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.cfg = load_config(None, ["model.path=unused", "data.train_files=[unused]", "model.dtype=bfloat16", "rollout.engine=vllm", *overrides])
    trainer.dims = types.SimpleNamespace(dp=1, rank=0)
    trainer.global_batch = GlobalBatch(trainer.dims)
    trainer.actor = types.SimpleNamespace(spec=types.SimpleNamespace(family="llama"))
    trainer.lines = []
    trainer.log = trainer.lines.append
    trainer.step, trainer._sync_checked = 1, False
    return trainer


def rollout(gap: float) -> tuple[RolloutBatch, torch.Tensor, torch.Tensor]:
    """Engine log-probs `gap` away from the actor's on every response token; [2, 4]."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    actor = torch.full((2, 4), -1.0)
    batch = RolloutBatch(samples=[], batch=None, rollout_logprobs=actor + gap * mask, logprobs_are_scaled=True,
                         group_ids=torch.tensor([0, 0]))
    return batch, actor, mask


def test_first_sync_over_the_limit_raises():
    trainer = bare_trainer()
    with pytest.raises(WeightSyncMismatch, match=r"rollout.engine=vllm \(llama model\).*mean 0\.1.*mean <= 0\.07.*first sync"):
        trainer._verify_sync(*rollout(0.1))


def test_later_sync_over_the_limit_fires_the_guard_and_goes_on():
    trainer = bare_trainer()
    first = trainer._verify_sync(*rollout(0.03))  # passes: metrics, no event
    assert first.events == [] and first.metrics["training/sync_logprob_diff_mean"] == pytest.approx(0.03)
    trainer.step = 2
    later = trainer._verify_sync(*rollout(0.1))  # would have raised on the first sync
    (name, fields), = later.events
    assert name == "guard/weight_sync" and fields["mean_limit"] == 0.07
    assert fields["training/sync_logprob_diff_mean"] == pytest.approx(0.1)
    assert later.metrics["training/sync_logprob_diff_p99"] == pytest.approx(0.1)
    assert len(trainer.lines) == 1 and "step 2: guard/weight_sync" in trainer.lines[0]


def test_mean_limit_knob():
    trainer = bare_trainer("rollout.verify_weights_mean_atol=0.2")
    assert trainer._verify_sync(*rollout(0.1)).events == []  # first sync, under 0.2
    trainer.step = 2
    (name, fields), = trainer._verify_sync(*rollout(0.25)).events
    assert name == "guard/weight_sync" and fields["mean_limit"] == 0.2
    with pytest.raises(WeightSyncMismatch, match=r"mean <= 0\.01"):
        bare_trainer("rollout.verify_weights_mean_atol=0.01")._verify_sync(*rollout(0.03))
