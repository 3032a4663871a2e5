"""PPO losses and their aggregation over the global batch.

Shapes: every tensor is `[batch, response_len]` (one micro-batch) unless noted.

## Global-batch aggregation (read this before wiring the engine)

A PPO mini-batch (the "global batch" of one optimizer step) is processed as several micro-batches
on each of several data-parallel ranks. `agg_loss` defines the loss over the *global* batch, so the
gradient does not depend on how the batch is cut. Each call returns this micro-batch's
*contribution*; summing contributions over all micro-batches and all DP ranks gives exactly the
loss of the whole batch processed at once:

    mode                     contribution of one micro-batch
    token-mean               sum_tokens(loss) / global_tokens
    seq-mean-token-sum       sum_seqs(sum_tokens(loss)) / global_seqs
    seq-mean-token-mean      sum_seqs(mean_tokens(loss)) / global_seqs
    seq-mean-token-sum-norm  sum_seqs(sum_tokens(loss)) / (global_seqs * loss_scale_factor)

global_tokens: valid (mask != 0) tokens in the global batch, all micro-batches and DP ranks.
global_seqs: sequences with at least one valid token in the global batch (all-masked rows are
    excluded, as verl does; they contribute nothing).
loss_scale_factor: the constant of seq-mean-token-sum-norm (Dr.GRPO's MAX_TOKENS); verl's default is
    `mask.shape[-1]`, which changes with per-micro-batch padding, so with totals it must be given.

The engine counts both totals once per optimizer step (one all-reduce over the DP group) and then
*sums* gradients: backward on each contribution as is, and reduce gradients with SUM over DP. If the
backend averages instead (Megatron DDP scales gradients by 1/dp_size; its pipeline schedule divides
the loss by num_microbatches unless `calculate_per_token_loss=True`), undo that scale.
verl's `agg_loss(..., dp_size=D, batch_num_tokens=T, global_batch_size=S)` equals D times ours with
`global_tokens=T, global_seqs=S` because verl pre-multiplies for DDP's averaging.

Without totals each mode reduces over the one batch it is given (verl's single-batch semantics).
"""
from __future__ import annotations

import torch

from megarl.algorithms.functional import masked_mean, masked_sum

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

Number = int | float | torch.Tensor


def _check_shapes(**tensors: torch.Tensor | None) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"these tensors must all have the same shape [batch, response_len], got {shapes}")


def _nonzero(denominator: Number) -> Number:
    # An empty global batch (or an all-masked local one) has a zero numerator too: return 0, not NaN.
    if isinstance(denominator, torch.Tensor):
        return torch.where(denominator != 0, denominator, torch.ones_like(denominator))
    return denominator if denominator != 0 else 1


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_tokens: Number | None = None,
    global_seqs: Number | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [batch, response_len] to this batch's scalar contribution (see module doc).

    mode: one of AGG_MODES. With no totals the loss is reduced over this batch alone. With totals
    (ints or 0-d tensors counted over the global batch) the results of all micro-batches on all DP
    ranks sum to the global-batch loss: token-mean needs `global_tokens`, the seq-mean modes need
    `global_seqs`, and seq-mean-token-sum-norm also needs `loss_scale_factor`.
    Rows with no valid token contribute 0 and never produce NaN.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    _check_shapes(loss_mat=loss_mat, mask=mask)
    mask = mask.to(loss_mat.dtype)
    has_totals = global_tokens is not None or global_seqs is not None

    if mode == "token-mean":
        if has_totals and global_tokens is None:
            raise ValueError(
                "agg mode 'token-mean' with global totals needs global_tokens (valid tokens in the global batch)"
            )
        tokens = mask.sum() if global_tokens is None else global_tokens
        return masked_sum(loss_mat, mask) / _nonzero(tokens)

    if has_totals and global_seqs is None:
        raise ValueError(f"agg mode {mode!r} with global totals needs global_seqs (sequences with a valid token)")
    if mode == "seq-mean-token-sum-norm" and has_totals and loss_scale_factor is None:
        raise ValueError(
            "agg mode 'seq-mean-token-sum-norm' with global totals needs loss_scale_factor (e.g. the max response "
            "length), so every micro-batch divides by the same constant whatever its padded length"
        )
    tokens_per_seq = mask.sum(dim=-1)  # [batch]
    seq_losses = masked_sum(loss_mat, mask, dim=-1)  # [batch] token sums
    if mode == "seq-mean-token-mean":
        seq_losses = seq_losses / _nonzero(tokens_per_seq)
    seqs = (tokens_per_seq > 0).sum().to(loss_mat.dtype) if global_seqs is None else global_seqs
    loss = seq_losses.sum() / _nonzero(seqs)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    agg: str = "token-mean",
    *,
    global_tokens: Number | None = None,
    global_seqs: Number | None = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss (Schulman et al. 2017, https://arxiv.org/abs/1707.06347).

    logp: [batch, response_len] log-probs of the taken tokens under the policy being trained (with
    grad); old_logp: the same under the policy that generated the batch; advantages, response_mask:
    [batch, response_len]. Returns (loss, metrics); loss is this micro-batch's contribution (see
    `agg_loss`; totals are forwarded to it).

    ratio = exp(clamp(logp - old_logp, -20, 20)) (clamped so a stale token cannot overflow exp);
    pg_losses1 = -A * ratio; pg_losses2 = -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    (asymmetric "clip-higher" as in DAPO, https://arxiv.org/abs/2503.14476); per token
    max(pg_losses1, pg_losses2), and for A < 0 additionally min(., -A * clip_ratio_c): the dual-clip
    lower bound (Ye et al. 2020, https://arxiv.org/abs/1912.09729) so a token whose ratio exploded
    cannot produce an unbounded loss. rollout_is_weights [batch, response_len], if given, multiply
    the per-token loss (importance correction for a rollout engine that differs from the trainer).

    metrics (0-d tensors without grad, masked means over this call's valid tokens, verl's definitions;
    tensors, not floats, so the loss never waits on the device: the engine sums them over the step's
    micro-batches and reads them once per train step):
      actor/pg_clipfrac: fraction of tokens where the clipped term is the larger loss;
      actor/pg_clipfrac_lower: fraction with A < 0 where the dual-clip bound is active;
      actor/ppo_kl: mean of old_logp - logp (after the +-20 clamp).
    To combine over micro-batches and DP ranks, weight each by its valid token count
    (response_mask.sum()); that reproduces the global-batch value exactly.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(
            f"clip_ratio_c is the dual-clip lower bound on the ratio for A < 0 and must be > 1, got {clip_ratio_c}; "
            "use 3.0 (the default), or a large value such as 1e9 to effectively disable dual-clip"
        )
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(f"clip ratios must be >= 0, got low={clip_ratio_low}, high={clip_ratio_high}")
    _check_shapes(logp=logp, old_logp=old_logp, advantages=advantages, response_mask=response_mask,
                  rollout_is_weights=rollout_is_weights)

    log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    loss = agg_loss(pg_losses, response_mask, agg, global_tokens=global_tokens, global_seqs=global_seqs,
                    loss_scale_factor=loss_scale_factor)

    with torch.no_grad():
        mask = response_mask.to(logp.dtype)
        pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).to(logp.dtype), mask)
        dual_clipped = (clip_pg_losses1 > pg_losses3) & (advantages < 0)
        pg_clipfrac_lower = masked_mean(dual_clipped.to(logp.dtype), mask)
        ppo_kl = masked_mean(-log_ratio, mask)
    metrics = {"actor/pg_clipfrac": pg_clipfrac, "actor/pg_clipfrac_lower": pg_clipfrac_lower, "actor/ppo_kl": ppo_kl}
    return loss, metrics


def gspo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    agg: str = "seq-mean-token-mean",
    *,
    global_tokens: Number | None = None,
    global_seqs: Number | None = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: PPO clipping on a sequence-level ratio (Zheng et al. 2025, https://arxiv.org/abs/2507.18071).

    Shapes and return as `policy_loss`. The sequence ratio is the geometric mean of the token ratios,
    s_i = exp(mean_t(logp - old_logp)) over the valid tokens of sequence i; GSPO-token form
    s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)], whose value is s_i and whose gradient is
    s_i * grad logp_t. The log of s_i,t is clamped at 10 (verl's bound), then clipped to
    [1 - clip_ratio_low, 1 + clip_ratio_high]; the defaults are the paper's (3e-4, 4e-4), far
    tighter than token-level PPO's because a sequence ratio varies much less.
    GSPO's loss is defined with seq-mean-token-mean, the default here; verl forces that mode, megarl
    lets `agg` override it. No dual-clip: actor/pg_clipfrac_lower is always 0.
    """
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(f"clip ratios must be >= 0, got low={clip_ratio_low}, high={clip_ratio_high}")
    _check_shapes(logp=logp, old_logp=old_logp, advantages=advantages, response_mask=response_mask,
                  rollout_is_weights=rollout_is_weights)
    mask = response_mask.to(logp.dtype)
    log_ratio = logp - old_logp
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1)  # [batch]
    log_seq_ratio = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))
    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    loss = agg_loss(pg_losses, response_mask, agg, global_tokens=global_tokens, global_seqs=global_seqs,
                    loss_scale_factor=loss_scale_factor)

    with torch.no_grad():
        pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).to(logp.dtype), mask)
        ppo_kl = masked_mean(-log_ratio, mask)
    metrics = {"actor/pg_clipfrac": pg_clipfrac, "actor/pg_clipfrac_lower": torch.zeros_like(pg_clipfrac),
               "actor/ppo_kl": ppo_kl}
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float,
    agg: str = "token-mean",
    *,
    global_tokens: Number | None = None,
    global_seqs: Number | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss of PPO's critic (as in openai/baselines ppo2 and verl).

    values: [batch, response_len] current critic predictions (with grad); old_values: the critic's
    predictions when the batch was collected; returns: the targets (GAE advantages + old values).
    loss = 0.5 * agg(max((v - R)^2, (clip(v, old - clip_range, old + clip_range) - R)^2)): the
    critic may not move further than clip_range from old_values to reduce the loss.
    metrics: critic/vf_clipfrac, the fraction of valid tokens where the clipped term is the larger
    (a 0-d tensor, as policy_loss's; combine across micro-batches weighted by valid token count).
    """
    if clip_range < 0:
        raise ValueError(f"clip_range must be >= 0, got {clip_range}")
    _check_shapes(values=values, old_values=old_values, returns=returns, response_mask=response_mask)
    values_clipped = torch.clamp(values, old_values - clip_range, old_values + clip_range)
    v_loss_unclipped = (values - returns) ** 2
    v_loss_clipped = (values_clipped - returns) ** 2
    v_loss_max = torch.maximum(v_loss_unclipped, v_loss_clipped)
    loss = 0.5 * agg_loss(v_loss_max, response_mask, agg, global_tokens=global_tokens, global_seqs=global_seqs,
                          loss_scale_factor=loss_scale_factor)
    with torch.no_grad():
        vf_clipfrac = masked_mean((v_loss_clipped > v_loss_unclipped).to(values.dtype), response_mask)
    return loss, {"critic/vf_clipfrac": vf_clipfrac}
