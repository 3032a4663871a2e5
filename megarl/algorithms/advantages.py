"""Advantage estimators: GAE, GRPO (and Dr.GRPO), RLOO, REINFORCE++ and ReMax.

All are pure functions of one rollout batch, computed once per PPO step on the whole batch
(before it is split into micro-batches and data-parallel shards), without gradient.
Shapes: `[batch, response_len]` for token tensors, `[batch]` for per-sequence scores.
Definitions follow verl's `verl/trainer/ppo/core_algos.py`; docs/algorithms.md lists where
megarl differs (GAE returns un-whitened advantages).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megarl.algorithms.functional import masked_whiten


def _check_shapes(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"these tensors must all have the same shape [batch, response_len], got {shapes}")


def _check_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"scores must be [batch] and response_mask [batch, response_len] with the same batch, got "
            f"scores {tuple(scores.shape)} and response_mask {tuple(response_mask.shape)}; "
            "for token-level rewards pass token_rewards.sum(-1)."
        )
    return scores if scores.is_floating_point() else scores.to(torch.get_default_dtype())


def _group_index(group_ids: torch.Tensor | Sequence[Any], batch: int, device: torch.device) -> torch.Tensor:
    """Map arbitrary group ids ([batch]: ints, strings such as prompt uids) to 0..n_groups-1."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.shape != (batch,):
            raise ValueError(f"group_ids must have shape [batch]=({batch},), got {tuple(group_ids.shape)}")
        return torch.unique(group_ids, return_inverse=True)[1].to(device)
    ids = list(group_ids)
    if len(ids) != batch:
        raise ValueError(f"group_ids must have one id per sequence ({batch}), got {len(ids)}")
    position: dict[Any, int] = {}
    index = [position.setdefault(g, len(position)) for g in ids]
    return torch.tensor(index, dtype=torch.long, device=device)


def _group_count_sum(scores: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group size and score sum, each [n_groups]."""
    n_groups = int(index.max()) + 1 if index.numel() else 0
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count = zeros.clone().index_add_(0, index, torch.ones_like(scores))
    total = zeros.clone().index_add_(0, index, scores)
    return count, total


@torch.no_grad()
def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, https://arxiv.org/abs/1506.02438).

    token_rewards, values, response_mask: [batch, response_len]. Returns (advantages, returns),
    both [batch, response_len], with returns = advantages + values (the critic's target).

    The backward recursion `delta_t = r_t + gamma * V_next - V_t`, `A_t = delta_t + gamma * lam * A_next`
    runs over policy tokens only: on a masked-out token inside a response (a tool/environment
    observation in a multi-turn rollout) nothing is decided, so the next policy token's value and
    advantage are carried across it unchanged and its reward is ignored. Masked positions therefore
    hold the carried advantage (as in verl), which the losses never read.

    Advantages are NOT whitened (verl whitens inside its GAE); call
    `masked_whiten(advantages, response_mask)` for PPO's usual normalisation.
    """
    _check_shapes(token_rewards=token_rewards, values=values, response_mask=response_mask)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    is_policy_token = response_mask.bool()
    batch, response_len = values.shape
    next_value = values.new_zeros(batch)
    lastgaelam = values.new_zeros(batch)
    advantages = torch.zeros_like(values)
    for t in reversed(range(response_len)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * lastgaelam
        # torch.where, not v*m + (1-m)*carry: values on padding may be garbage (even NaN).
        next_value = torch.where(is_policy_token[:, t], values[:, t], next_value)
        lastgaelam = torch.where(is_policy_token[:, t], gae_t, lastgaelam)
        advantages[:, t] = lastgaelam
    returns = advantages + values
    return advantages, returns


@torch.no_grad()
def compute_grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Any],
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO group-normalised outcome advantage (Shao et al. 2024, https://arxiv.org/abs/2402.03300).

    scores: [batch] one scalar reward per response. group_ids: [batch] (tensor, list or numpy
    array; e.g. the prompt uid): responses to the same prompt share an id.
    Returns [batch, response_len]: per group `(s - mean) / (std + eps)` with the unbiased std,
    broadcast over the response tokens and zero on masked tokens.
    norm_by_std=False gives Dr.GRPO's `s - mean` (Liu et al. 2025, https://arxiv.org/abs/2503.20783).
    A group of one has no baseline: mean 0, std 1 (so its advantage is s / (1 + eps)), as in verl.
    """
    scores = _check_scores(scores, response_mask)
    index = _group_index(group_ids, scores.shape[0], scores.device)
    count, total = _group_count_sum(scores, index)
    mean = total / count
    sq_dev = torch.zeros_like(count).index_add_(0, index, (scores - mean[index]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))  # unbiased (torch.std), as verl
    singleton = count == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    centered = scores - mean[index]
    advantage = centered / (std[index] + eps) if norm_by_std else centered
    return advantage.unsqueeze(-1) * response_mask.to(advantage.dtype)


@torch.no_grad()
def compute_rloo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Any],
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """REINFORCE Leave-One-Out advantage (Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740).

    scores: [batch], group_ids: [batch] as in `compute_grpo_advantages`. Returns [batch, response_len]:
    `s_i - mean_{j != i} s_j` over the group (= `s_i * n/(n-1) - mean * n/(n-1)` in verl's form),
    broadcast over the response tokens and zero on masked tokens. A group of one has no other
    sample to compare with and keeps its raw score (baseline 0), as verl's `rloo` estimator does.
    """
    scores = _check_scores(scores, response_mask)
    index = _group_index(group_ids, scores.shape[0], scores.device)
    count, total = _group_count_sum(scores, index)
    n = count[index]
    leave_one_out_baseline = (total[index] - scores) / (n - 1).clamp(min=1)
    advantage = torch.where(n > 1, scores - leave_one_out_baseline, scores)
    return advantage.unsqueeze(-1) * response_mask.to(advantage.dtype)


@torch.no_grad()
def compute_reinforce_pp_returns(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
) -> torch.Tensor:
    """Discounted returns for REINFORCE++ (Hu 2025, https://arxiv.org/abs/2501.03262).

    token_rewards, response_mask: [batch, response_len]; returns [batch, response_len] with
    `G_t = r_t + gamma * G_{t+1}` over policy tokens. A masked-out token inside a response (a
    tool/environment observation in a multi-turn rollout) is skipped as GAE skips it: the running
    return is carried across it unchanged (no discount step, its reward ignored), so an earlier turn
    sees the rewards placed after the hole, as in verl 0.9. Masked positions hold the carried return,
    which the losses never read. The REINFORCE++ advantage is these returns whitened over the
    batch: see `compute_reinforce_pp_advantages`.
    """
    _check_shapes(token_rewards=token_rewards, response_mask=response_mask)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    is_policy_token = response_mask.bool()
    running = token_rewards.new_zeros(token_rewards.shape[0])
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[1])):
        # torch.where, not a product with the mask: rewards on padding may be garbage (even NaN).
        running = torch.where(is_policy_token[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns


@torch.no_grad()
def compute_reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (advantages, returns), both [batch, response_len].

    advantages = masked_whiten(returns, response_mask), zero on masked tokens: the whitening statistics are
    over the whole batch given, so call it on the full rollout batch, not per micro-batch.
    """
    returns = compute_reinforce_pp_returns(token_rewards, response_mask, gamma)
    whitened = masked_whiten(returns, response_mask)
    advantages = torch.where(response_mask.bool(), whitened, torch.zeros_like(whitened))
    return advantages, returns


@torch.no_grad()
def compute_remax_advantages(
    scores: torch.Tensor,
    baseline_scores: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """ReMax advantage (Li et al. 2023, https://arxiv.org/abs/2310.10505): `scores - baseline_scores`.

    scores: [batch] outcome rewards of the sampled responses; baseline_scores: [batch] rewards of a
    greedy rollout of the same prompts. Returns [batch, response_len], zero on masked tokens.
    scores may instead be token-level rewards [batch, response_len]: the return-to-go
    `sum_{t' >= t} r_t' * mask_t'` then replaces the score, exactly verl's `compute_remax_outcome_advantage`
    (identical to the [batch] form on policy tokens when the reward sits on the last policy token).
    """
    if baseline_scores.dim() != 1 or baseline_scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"baseline_scores must be [batch]=({response_mask.shape[0]},), got {tuple(baseline_scores.shape)}"
        )
    if scores.dim() == 2:
        _check_shapes(token_rewards=scores, response_mask=response_mask)
        mask = response_mask.to(scores.dtype)
        returns_to_go = (scores * mask).flip(-1).cumsum(-1).flip(-1)
        return returns_to_go - baseline_scores.unsqueeze(-1) * mask
    scores = _check_scores(scores, response_mask)
    return (scores - baseline_scores).unsqueeze(-1) * response_mask.to(scores.dtype)
