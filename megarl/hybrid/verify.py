"""Is the rollout engine running the weights the actor trains? Checks and per-step metrics.

Every step the trainer compares the engine's log-probs of its own samples with the actor's
recomputation of them (`compare_logprobs`): a wrong name mapping, a missed tensor or a mis-split
fused layout shows up as a large gap on the first step instead of as a slowly diverging run.
`token_prob_diff` is the per-token gap behind verl's `training/rollout_probs_diff_*` metrics
(reduced over the global batch in megarl.step_metrics; `rollout_probs_diff_metrics` gives this
rank's values). The probe-batch check used by tests is tests/hybrid/sync_probe.py.
"""
from __future__ import annotations

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
