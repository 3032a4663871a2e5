"""Phase 5 of a PPO step: the rewards as the estimators read them (`scores_at_last_token`), ReMax's
greedy baseline (`remax_baseline`) and `compute_advantages`, which runs the configured estimator
(GAE / GRPO / RLOO / REINFORCE++ / ReMax, megarl.algorithms) on the all-gathered global batch and
keeps this rank's rows, so every layout computes the same numbers."""
from __future__ import annotations

import torch

from megarl import algorithms as A
from megarl.config.schema import AlgorithmConfig
from megarl.step.global_batch import GlobalBatch
from megarl.step.samples import RolloutBatch


def scores_at_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[m] sequence scores -> [m, R] token rewards with the score on the last policy token (a
    multi-turn response's mask has holes where the environment spoke)."""
    token = torch.zeros_like(mask)
    positions = torch.arange(mask.shape[-1]).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(-1).values.clamp_min(0)
    token[torch.arange(len(scores)), last] = scores * (mask.sum(-1) > 0)
    return token


def remax_baseline(greedy_scores: list[float], samples_per_prompt: int) -> torch.Tensor:
    """[m] ReMax's baseline: the score of one greedy response per prompt, repeated for its samples."""
    return torch.tensor(greedy_scores, dtype=torch.float32).repeat_interleave(samples_per_prompt)


def compute_advantages(alg: AlgorithmConfig, global_batch: GlobalBatch, rollout_batch: RolloutBatch, scores: torch.Tensor,
                       token_rewards: torch.Tensor, values: torch.Tensor | None,
                       baseline: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, R] advantages and returns of this rank's rows, computed on the all-gathered global
    batch (`values`: the critic's, GAE; `baseline`: ReMax's [m] `remax_baseline` of this rank's
    rows). scores: [m] what GRPO / RLOO / ReMax read; token_rewards: [m, R] what GAE and REINFORCE++ read."""
    batch = rollout_batch.batch
    mask = batch.response_mask
    g_mask, g_rewards, g_scores, g_groups, *g_values = global_batch.gather(
        mask, token_rewards, scores, rollout_batch.group_ids.float(), *([values] if values is not None else []))
    if alg.adv_estimator == "gae":
        advantages, returns = A.compute_gae(g_rewards, g_values[0], g_mask, alg.gamma, alg.lam)
        advantages = A.masked_whiten(advantages, g_mask)
    elif alg.adv_estimator == "grpo":
        advantages = A.compute_grpo_advantages(g_scores, g_groups.long(), g_mask, norm_by_std=alg.norm_adv_by_std_in_grpo)
        returns = advantages
    elif alg.adv_estimator == "rloo":
        advantages = A.compute_rloo_advantages(g_scores, g_groups.long(), g_mask)
        returns = advantages
    elif alg.adv_estimator == "reinforce_plus_plus":
        advantages, returns = A.compute_reinforce_pp_advantages(g_rewards, g_mask, alg.gamma)
    else:  # remax: baseline = score of a greedy response to the same prompt
        assert baseline is not None, "ReMax advantages need the greedy responses' baseline (remax_baseline)"
        (g_baseline,) = global_batch.gather(baseline)
        advantages = A.compute_remax_advantages(g_scores, g_baseline, g_mask)
        returns = advantages
    first = global_batch.offset(len(batch))
    return advantages[first : first + len(batch)] * mask, returns[first : first + len(batch)] * mask
