"""algorithm.rollout_correction in the trainer: the weights and loss mask of the configured mode
(megarl.algorithms.rollout_correction) for the step's record (megarl.step.step_record.Correction), and the
rollout_corr/ metrics reduced over the global batch.

The behaviour log-probs are the engine's of softmax(logits / T) over the allowed vocabulary without
top-k/top-p truncation (`RolloutBatch.logprobs_are_scaled`), the distribution the trainer's
old log-probs are computed under: the truncated ("processed") ones differ from it by log(kept mass)
at every token, so every ratio would carry that bias (docs/algorithms.md, "Off-policy correction").
"""
from __future__ import annotations

import torch

from megarl.algorithms import compute_rollout_correction
from megarl.algorithms.rollout_correction import finish_metrics, metric_partials
from megarl.step.global_batch import GlobalBatch, LocalStats
from megarl.step.step_record import Correction


def apply(rc, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, logprobs_are_scaled: bool,
          global_batch: GlobalBatch) -> Correction:
    """The mode's weights and, where it rejects samples, its loss mask (each [n, R], in the mask's
    dtype), with the rollout_corr/ metrics, identical on every rank (one DP reduction).
    rc: the algorithm.rollout_correction config; old_logprobs: the actor's (the proximal policy)."""
    if not logprobs_are_scaled:
        if rc.mode != "none":  # validation refuses this combination; a new engine could still get here
            raise RuntimeError(f"algorithm.rollout_correction.mode={rc.mode} needs the engine's scaled log-probs (untruncated, at the "
                               f"sampling temperature), which this rollout engine did not return with rollout.top_p / top_k "
                               f"set (vLLM returns them only under its V1 model runner: VLLM_USE_V2_MODEL_RUNNER=0; "
                               f"docs/algorithms.md): use mode=none, or drop the truncation")
        return Correction()
    corr = compute_rollout_correction(
        old_logprobs, rollout_logprobs, mask, rc.mode, rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold, rollout_rs_threshold=rc.rollout_rs_threshold,
        rollout_rs_threshold_lower=rc.rollout_rs_threshold_lower, icepop_low=rc.icepop_low, icepop_high=rc.icepop_high,
        behav_imp_weight_cap=rc.behav_imp_weight_cap)
    weights = corr.weights.to(mask.dtype) if corr.weights is not None else None
    loss_mask = corr.loss_mask.to(mask.dtype) if corr.loss_mask is not mask else None
    stats = LocalStats()
    for kind, name, x, weight in metric_partials(corr, old_logprobs, rollout_logprobs, mask):
        if kind == "mean":
            stats.masked_mean(name, x, weight)
        else:
            getattr(stats, kind)(name, x)
    return Correction(weights, loss_mask, finish_metrics(global_batch.reduce(stats)))
