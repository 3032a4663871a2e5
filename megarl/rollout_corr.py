"""algorithm.rollout_correction in the trainer: the weights and loss mask of the configured mode
(megarl.algorithms.rollout_correction) go into the step's batch, and the rollout_corr/ metrics are
reduced over the global batch.

The behaviour log-probs are the engine's of softmax(logits / T) over the allowed vocabulary without
top-k/top-p truncation (`RolloutBatch.logprobs_are_scaled`), the distribution the trainer's
old log-probs are computed under: the truncated ("processed") ones differ from it by log(kept mass)
at every token, so every ratio would carry that bias (docs/algorithms.md, "Off-policy correction").
"""
from __future__ import annotations

from dataclasses import replace

import torch

from megarl.algorithms import compute_rollout_correction
from megarl.algorithms.rollout_correction import finish_metrics, metric_partials
from megarl.engine.batch import SequenceBatch
from megarl.global_batch import GlobalBatch, LocalStats

WEIGHTS = "rollout_is_weights"
LOSS_MASK = "rollout_corr_loss_mask"


def apply(rc, batch: SequenceBatch, rollout_logprobs: torch.Tensor, logprobs_are_raw: bool,
          global_batch: GlobalBatch) -> dict[str, float]:
    """Put the mode's weights (WEIGHTS) and, where it rejects samples, its loss mask (LOSS_MASK) into
    batch.tensors; return the rollout_corr/ metrics, identical on every rank (one DP reduction).
    rc: the algorithm.rollout_correction config; batch.tensors["old_logprobs"] must be set."""
    if not logprobs_are_raw:
        if rc.mode != "none":  # validation refuses this combination; a new engine could still get here
            raise RuntimeError(f"algorithm.rollout_correction.mode={rc.mode} needs the engine's untruncated log-probs at the "
                               f"sampling temperature, which this rollout engine did not return with rollout.top_p / top_k "
                               f"set (vLLM returns them only under its V1 model runner: VLLM_USE_V2_MODEL_RUNNER=0; "
                               f"docs/algorithms.md): use mode=none, or drop the truncation")
        return {}
    mask = batch.response_mask
    corr = compute_rollout_correction(
        batch.tensors["old_logprobs"], rollout_logprobs, mask, rc.mode, rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold, rollout_rs_threshold=rc.rollout_rs_threshold,
        rollout_rs_threshold_lower=rc.rollout_rs_threshold_lower, icepop_low=rc.icepop_low, icepop_high=rc.icepop_high,
        behav_imp_weight_cap=rc.behav_imp_weight_cap)
    if corr.weights is not None:
        batch.tensors[WEIGHTS] = corr.weights.to(mask.dtype)
    if corr.loss_mask is not mask:
        batch.tensors[LOSS_MASK] = corr.loss_mask.to(mask.dtype)
    stats = LocalStats()
    for kind, name, x, weight in metric_partials(corr, batch.tensors["old_logprobs"], rollout_logprobs, mask):
        if kind == "mean":
            stats.masked_mean(name, x, weight)
        else:
            getattr(stats, kind)(name, x)
    return finish_metrics(global_batch.reduce(stats))


def actor_batch(batch: SequenceBatch) -> SequenceBatch:
    """The batch the actor trains on: rejected samples (LOSS_MASK) leave the response mask, so the
    loss's totals (tokens, sequences) count only what the update uses, as verl's rejection does."""
    if LOSS_MASK not in batch.tensors:
        return batch
    return replace(batch, tensors={**batch.tensors, "response_mask": batch.tensors[LOSS_MASK]})


def actor_fields(batch: SequenceBatch) -> tuple[str, ...]:
    """The per-token fields the actor's loss reads beyond the defaults: the weights, when set."""
    return (WEIGHTS,) if WEIGHTS in batch.tensors else ()
