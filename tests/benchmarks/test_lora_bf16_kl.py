"""benchmarks/lora_bf16_kl.py at tiny size: what holds by construction, not the measured sizes."""
from __future__ import annotations

import math

import torch

from lora_bf16_kl import VARIANTS, measure


def test_lora_bf16_kl_tiny():
    torch.manual_seed(0)
    run = measure(preset="tiny", seed=0, rel=0.03, tokens=8, rows=2, also_fp32_lowrank=True)
    for ref in ("train", "train_fp32_lowrank"):
        for v in VARIANTS:
            kl = run["kl"][ref][v]
            assert math.isfinite(kl["mean"]) and 0.0 <= kl["mean"] <= kl["max"], (ref, v, kl)
    # Float32 merge then one cast is round-to-nearest of W + delta, element by element, so it can only
    # lose less of the update than rounding the delta to bf16 first and adding in bf16.
    lost = run["update_lost"]
    assert lost["fp32_merge_cast"] <= lost["bf16_merge"]
    assert 0.0 < lost["fp32_merge_cast"] < 0.5  # the merge keeps the update, up to bf16 rounding of W + delta
    # Adapter-only with a power-of-two scale (alpha 32 / rank 16) is the trainer's own arithmetic but for
    # the kernel that computes h = x @ A^T (vLLM's float32 shrink, megarl's bf16 matmul): it stays well
    # below a merge (0 here; at most 0.0005 against >= 0.00165 in the 9 runs of the recorded result).
    merged_low = min(run["kl"]["train"][v]["mean"] for v in ("bf16_merge", "fp32_merge_cast"))
    assert run["kl"]["train"]["adapter_only"]["mean"] < merged_low / 3
    # The adapters move the policy far more than any hand-over's rounding: the KL measures something.
    merged_high = max(run["kl"]["train"][v]["mean"] for v in ("bf16_merge", "fp32_merge_cast"))
    assert run["kl"]["train"]["base_only"]["mean"] > 3 * merged_high
    # Not asserted, because it is not robust: the two merges' KLs. fp32_merge_cast's mean KL was above
    # bf16_merge's in 3 of the 9 recorded runs (benchmarks/results/lora_bf16_kl_cpu.json): both round
    # W + delta onto the bf16 grid once, and the extra rounding of the small delta barely matters.
