"""Post-sync verification and the train/rollout probability-gap metrics, hand-worked."""
from __future__ import annotations


import pytest
import torch

from megarl.hybrid.verify import WeightSyncMismatch, compare_logprobs, rollout_probs_diff_metrics


def test_compare_logprobs_passes_within_tolerance_and_ignores_padding():
    engine = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    actor = torch.tensor([[-1.001, -2.0, -50.0], [-0.5, -7.0, 0.0]])  # -50 and -7 sit on padding
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert compare_logprobs(engine, actor, mask, atol=1e-2) == pytest.approx(0.001, abs=1e-6)


def test_compare_logprobs_names_the_worst_position():
    engine = torch.tensor([[-1.0, -2.0], [-0.5, -0.25]])
    actor = torch.tensor([[-1.0, -2.1], [-0.5, -3.25]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    with pytest.raises(WeightSyncMismatch, match=r"max \|logprob diff\| = 3 > atol 0.01 at sample 1, response position 1"):
        compare_logprobs(engine, actor, mask, atol=0.01)
    with pytest.raises(WeightSyncMismatch):  # NaN is a mismatch, not a pass
        compare_logprobs(torch.tensor([[float("nan")]]), torch.tensor([[0.0]]), torch.tensor([[True]]), atol=1.0)


def test_probs_diff_metrics_in_probability_space():
    # probs: rollout [0.5, 0.25], actor [0.25, 0.25] -> diffs [0.25, 0]; third position masked
    rollout = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    actor = torch.log(torch.tensor([[0.25, 0.25, 0.1]]))
    mask = torch.tensor([[True, True, False]])
    m = rollout_probs_diff_metrics(rollout, actor, mask)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.125)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.25)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(0.125)
    assert rollout_probs_diff_metrics(rollout, actor, torch.zeros_like(mask))["training/rollout_probs_diff_max"] == 0.0


def test_sync_check_uses_the_mean_for_bf16_and_names_engine_and_family():
    from megarl.hybrid.verify import check_sync

    mask = torch.ones(2, 4, dtype=torch.bool)
    actor = torch.zeros(2, 4)
    # bf16 kernel noise: small everywhere, one tail token at 0.3 (> the old max atol 0.1): passes
    noise = torch.tensor([[0.02, 0.03, 0.01, 0.3], [0.02, 0.01, 0.02, 0.03]])  # mean 0.055
    assert check_sync(noise, actor, mask, "bfloat16")["max"] == pytest.approx(0.3)
    # a corrupted layer moves every token: mean 0.1 > 0.07
    with pytest.raises(WeightSyncMismatch, match=r"rollout.engine=vllm \(qwen3_moe model\).*bfloat16.*mean 0\.1"):
        check_sync(torch.full((2, 4), 0.1), actor, mask, "bfloat16", where="rollout.engine=vllm (qwen3_moe model)")
    # float32 keeps a per-token bound as well
    with pytest.raises(WeightSyncMismatch, match="max <= 0.001"):
        check_sync(torch.tensor([[0.0, 0.0, 0.0, 0.05], [0.0] * 4]), actor, mask, "float32")
    with pytest.raises(WeightSyncMismatch):  # NaN is a mismatch
        check_sync(torch.full((2, 4), float("nan")), actor, mask, "bfloat16")
    with pytest.raises(ValueError, match="no sync check for dtype"):
        check_sync(noise, actor, mask, "int8")


def test_tail_statistic_beyond_quantiles_2_pow_24_limit():
    """One rank can hold more than 2^24 response tokens (2048 samples x 8192); torch.quantile refuses
    that many. Pattern of period 100: 2 tokens in every 100 off by 1.0 -> p99 is 1.0; with one in
    every 200 it is 0. The strided subsample (stride 17, coprime to 100) keeps those fractions."""
    from megarl.hybrid.verify import check_sync, tail_quantile

    n = 2**24 + 1
    period = torch.arange(n) % 100
    actor = ((period == 0) | (period == 50)).float()[None]  # [1, n]
    engine = torch.zeros(1, 1).expand(1, n)
    mask = torch.ones(1, 1, dtype=torch.bool).expand(1, n)
    with pytest.raises(RuntimeError, match="too large"):  # what the check used before
        actor.reshape(-1).quantile(0.99)
    stats = check_sync(engine, actor, mask, "bfloat16", mean_atol=0.05)  # mean 0.02
    assert stats["p99"] == 1.0 and stats["max"] == 1.0 and stats["tokens"] == n
    assert stats["mean"] == pytest.approx(0.02, abs=1e-4)
    assert tail_quantile(((torch.arange(n) % 200) == 0).float(), 0.99) == 0.0
    # exact (nearest rank) below the subsample size: 1..100 -> the 99th value
    assert tail_quantile(torch.arange(1, 101).float(), 0.99) == 99.0


def test_sync_check_mean_limit_can_be_set():
    from megarl.hybrid.verify import check_sync

    mask = torch.ones(2, 4, dtype=torch.bool)
    drift = torch.full((2, 4), 0.09)  # over bf16's calibrated 0.07
    with pytest.raises(WeightSyncMismatch, match=r"allowed mean <= 0\.07.*rollout\.verify_weights_mean_atol"):
        check_sync(drift, torch.zeros(2, 4), mask, "bfloat16")
    assert check_sync(drift, torch.zeros(2, 4), mask, "bfloat16", mean_atol=0.1)["mean"] == pytest.approx(0.09)
    with pytest.raises(WeightSyncMismatch, match=r"allowed mean <= 0\.05"):
        check_sync(torch.full((2, 4), 0.06), torch.zeros(2, 4), mask, "bfloat16", mean_atol=0.05)
