"""Is the rollout engine running the weights the actor trains? Checks and per-step metrics.

After a sync, `verify_sync` decodes a probe batch greedily with the engine and compares the
engine's log-probs of its own tokens with the actor's (recomputed by the trainer): a wrong name
mapping, a missed tensor or a mis-split fused layout shows up as a large gap on the first step
instead of as a slowly diverging run. Every step, `rollout_probs_diff_metrics` reports the gap
between rollout and actor token probabilities (verl's `training/rollout_probs_diff_*`).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from megarl.rollout.base import RolloutEngine, RolloutRequest, SamplingParams, pad_results


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


ActorLogprobFn = Callable[[list[list[int]], list[list[int]]], list[torch.Tensor]]


def verify_sync(engine: RolloutEngine, probe_prompts: Sequence[Sequence[int]], actor_logprobs: ActorLogprobFn, *,
                max_new_tokens: int = 16, atol: float = 1e-2, stop_token_ids: Sequence[int] = ()) -> float:
    """Greedy-decode `probe_prompts` with the engine; compare with `actor_logprobs(prompts, responses)`.

    actor_logprobs returns, per sequence, the actor's log-softmax(logits) (temperature 1) of each
    response token, shape [len(response)]. Greedy requests report unscaled log-probs in every
    engine, so the two are comparable. Returns the max diff; raises WeightSyncMismatch.
    atol: bf16 engines differ from an fp32 actor by ~1e-2 in log-prob; fp32 on CPU by ~1e-5.
    """
    requests = [RolloutRequest(tuple(p), i) for i, p in enumerate(probe_prompts)]
    results = engine.generate(requests, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_token_ids)))
    batch = pad_results(results)
    actor = actor_logprobs([list(p) for p in probe_prompts], [r.response_token_ids for r in results])
    actor_padded = torch.zeros_like(batch.logprobs)
    for i, lp in enumerate(actor):
        if lp.numel() != len(results[i].response_token_ids):
            raise ValueError(f"actor_logprobs returned {lp.numel()} values for a response of {len(results[i].response_token_ids)} tokens")
        actor_padded[i, :lp.numel()] = lp.float().cpu()
    return compare_logprobs(batch.logprobs, actor_padded, batch.mask, atol)
