"""The RL math of megarl: advantage estimators, PPO losses, KL estimators and controllers, and
on-policy distillation's reverse-KL terms.

Pure functions of tensors: no process groups inside (except the vocab-parallel full KL, which takes
the TP group explicitly); reductions over the global batch take its totals as arguments.
See docs/algorithms.md for the definitions and where they differ from verl.
"""
from megarl.algorithms.advantages import (
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_returns,
    compute_remax_advantages,
    compute_rloo_advantages,
)
from megarl.algorithms.distill import (
    DISTILL_MODES,
    distill_loss,
    distill_sequence_rewards,
    distill_token_rewards,
    reverse_kl_per_token,
)
from megarl.algorithms.functional import masked_mean, masked_sum, masked_var, masked_whiten
from megarl.algorithms.kl import (
    KL_KINDS,
    KL_KINDS_ALL,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    full_kl_penalty,
    kl_penalty,
)
from megarl.algorithms.losses import AGG_MODES, agg_loss, gspo_policy_loss, policy_loss, value_loss
from megarl.algorithms.rollout_correction import CORRECTION_MODES, CorrectionTerms, compute_rollout_correction

__all__ = [
    "AGG_MODES",
    "CORRECTION_MODES",
    "DISTILL_MODES",
    "CorrectionTerms",
    "KL_KINDS",
    "KL_KINDS_ALL",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_reinforce_pp_advantages",
    "compute_reinforce_pp_returns",
    "compute_remax_advantages",
    "compute_rloo_advantages",
    "distill_loss",
    "distill_sequence_rewards",
    "distill_token_rewards",
    "full_kl_penalty",
    "gspo_policy_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "reverse_kl_per_token",
    "compute_rollout_correction",
    "value_loss",
]
