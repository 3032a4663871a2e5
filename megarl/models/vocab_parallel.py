"""Log-probs, entropy and exact KL from vocab-parallel logits, without gathering the vocabulary.

Under tensor parallelism Megatron's output layer is column-parallel: TP rank r holds logits for
the vocabulary slice [vocab_start, vocab_start + vocab/tp) only, shape `[..., vocab/tp]`. Gathering
full-vocabulary logits (151k columns for Qwen) per token costs tp times the memory, so every
function here works on the local slice and all-reduces per-token scalars over `tp_group` instead.

Conventions shared by all functions:
- logits: `[..., local_vocab]` this rank's slice (any leading dims, e.g. [batch, response_len]).
  With `tp_group=None` (no TP) it is the full vocabulary.
- vocab_start: global id of this rank's first column; None means `tp_rank * local_vocab`, Megatron's
  even split.
- true_vocab_size: the tokenizer's vocabulary size. Megatron pads the vocabulary with extra columns
  at the end so TP divides it; columns with global id >= true_vocab_size are dropped here so padding
  never carries probability mass into log-probs, entropy or KL.
- banned_token_ids: global ids the policy may never emit (rollout.banned_token_ids). They are part of
  the policy's definition: the engines sample with their logits at -inf, so every result here is over
  the allowed vocabulary too (docs/algorithms.md, "Banned tokens"). Each id lies in one rank's slice;
  that rank sets its column to the dtype's lowest finite value, whose exp() underflows to exactly 0
  (the same distribution as -inf, without inf - inf = NaN in entropy and KL, or 0 * -inf where a
  masked position's target is a banned pad token). Its gradient is 0, like a padding column's.
- Sampling temperature: divide the logits (and the reference logits) by it before calling, exactly as
  the rollout engine did, so the log-probs are those of the sampling distribution.
- bf16/fp16 logits are computed in float32; float32/float64 stay as they are. Results are `[...]`.
- Every TP rank returns the same (replicated) value, and the backward pass gives each rank the
  gradient for its own slice of the logits only, as Megatron's vocab-parallel cross-entropy does.
  Call with the same arguments on every rank of `tp_group`: the all-reduces must match.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


class _AllReduceSumReplicatedOutput(torch.autograd.Function):
    """Sum over the TP group in forward; identity in backward (Megatron's `g` operator).

    Everything after the sum is computed identically on every TP rank, so the gradient each rank
    receives for the sum is already the full gradient; summing it again would scale it by tp.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: D102
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return grad, None


def _sum_over_tp(x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if tp_group is None else _AllReduceSumReplicatedOutput.apply(x, tp_group)


def _max_over_tp(x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    # The shift only keeps exp() in range; it cancels out of every result, so it needs no gradient.
    x = x.detach().clone()
    if tp_group is not None:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=tp_group)
    return x


def _valid_columns(
    logits: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    vocab_start: int | None,
    true_vocab_size: int | None,
    banned_token_ids: Sequence[int] = (),
) -> tuple[torch.Tensor, int]:
    """(this rank's logits without padding columns and with banned columns at the lowest finite value,
    in the compute dtype; global id of column 0)."""
    local_vocab = logits.shape[-1]
    if vocab_start is None:
        vocab_start = 0 if tp_group is None else dist.get_rank(tp_group) * local_vocab
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if true_vocab_size is not None:
        # Padding is a suffix of the global vocabulary, hence a suffix of each local slice
        # (possibly all of it on the last ranks): slicing drops it and gives it zero gradient.
        n_valid = max(0, min(local_vocab, true_vocab_size - vocab_start))
        logits = logits[..., :n_valid]
    local = [t - vocab_start for t in banned_token_ids if 0 <= t - vocab_start < logits.shape[-1]]
    if local:
        # index_fill copies (the caller's logits stay as they were) and gives the filled columns zero gradient.
        logits = logits.index_fill(-1, torch.tensor(local, device=logits.device), torch.finfo(logits.dtype).min)
    return logits, vocab_start


def _centered(x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """x - (global max over the vocabulary), so exp() of it lies in [0, 1]."""
    if x.shape[-1] > 0:
        local_max = x.detach().amax(dim=-1)
    else:  # this rank holds only padding columns
        local_max = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    return x - _max_over_tp(local_max, tp_group).unsqueeze(-1)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    true_vocab_size: int | None = None,
    banned_token_ids: Sequence[int] = (),
) -> torch.Tensor:
    """log p(target) = logit[target] - logsumexp(logits) over the allowed vocabulary.

    logits: [..., local_vocab]; target_ids: [...] global token ids (< true_vocab_size). Returns [...].
    A banned target gets a hugely negative (finite) log-prob: the policy cannot emit it.
    The rank whose slice holds the target contributes its logit, the others 0; logsumexp is a
    max all-reduce (no grad) and a differentiable sum-exp all-reduce. Three scalars per token cross
    the TP group (max, then sum-exp and target logit together).
    """
    if target_ids.shape != logits.shape[:-1]:
        raise ValueError(f"target_ids must have shape {tuple(logits.shape[:-1])} (logits without vocab), "
                         f"got {tuple(target_ids.shape)}")
    x, vocab_start = _valid_columns(logits, tp_group, vocab_start, true_vocab_size, banned_token_ids)
    if tp_group is None and x.shape[-1] > 0:
        # The whole vocabulary is here: one fused log_softmax pass (and one in backward) instead
        # of the centre / exp / sum / log passes the split vocabulary needs.
        return torch.log_softmax(x, dim=-1).gather(-1, (target_ids - vocab_start).unsqueeze(-1)).squeeze(-1)
    xc = _centered(x, tp_group)
    local_ids = target_ids - vocab_start
    is_local = (local_ids >= 0) & (local_ids < x.shape[-1])
    if x.shape[-1] > 0:
        gathered = xc.gather(-1, local_ids.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(is_local, gathered, torch.zeros_like(gathered))
    else:
        target_logit = xc.new_zeros(xc.shape[:-1])
    sums = _sum_over_tp(torch.stack([xc.exp().sum(dim=-1), target_logit], dim=-1), tp_group)
    sum_exp, target_logit = sums.unbind(-1)
    return target_logit - torch.log(sum_exp)


def vocab_parallel_entropy(
    logits: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    true_vocab_size: int | None = None,
    banned_token_ids: Sequence[int] = (),
) -> torch.Tensor:
    """Entropy H(p) = -sum_v p(v) log p(v) of softmax(logits) over the allowed vocabulary.

    logits: [..., local_vocab]. Returns [...]. Computed as log S - sum_v e_v x_v / S with
    x = logits - max, e = exp(x), S = sum_v e_v (the centred form of verl's
    `logsumexp - sum(p * logits)`, which avoids cancelling two large numbers).
    """
    x, _ = _valid_columns(logits, tp_group, vocab_start, true_vocab_size, banned_token_ids)
    xc = _centered(x, tp_group)
    e = xc.exp()
    sums = _sum_over_tp(torch.stack([e.sum(dim=-1), (e * xc).sum(dim=-1)], dim=-1), tp_group)
    sum_exp, sum_ex = sums.unbind(-1)
    return torch.log(sum_exp) - sum_ex / sum_exp


def vocab_parallel_full_kl(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    true_vocab_size: int | None = None,
    banned_token_ids: Sequence[int] = (),
) -> torch.Tensor:
    """Exact KL(pi || ref) = sum_v p(v) (log p(v) - log q(v)) per token, over the allowed vocabulary
    (both policies ban the same tokens).

    logits: [..., local_vocab] of the policy pi; ref_logits: the same slice of the reference policy.
    Returns [...]. The direction (policy first) is that of the per-token estimators in
    `megarl.algorithms.kl_penalty`, which estimate the same quantity from the sampled token only.
    Uses sum_v p(v) = 1: KL = E_p[x - y] - log S_x + log S_y with x, y the max-shifted logits.
    """
    if ref_logits.shape != logits.shape:
        raise ValueError(
            f"ref_logits must have the shape of logits {tuple(logits.shape)}, got {tuple(ref_logits.shape)}"
        )
    x, _ = _valid_columns(logits, tp_group, vocab_start, true_vocab_size, banned_token_ids)
    y, _ = _valid_columns(ref_logits, tp_group, vocab_start, true_vocab_size, banned_token_ids)
    y = y.to(x.dtype)
    # Both max-shifts in one all-reduce.
    if x.shape[-1] > 0:
        local_max = torch.stack([x.detach().amax(-1), y.detach().amax(-1)], dim=-1)
    else:
        local_max = torch.full((*x.shape[:-1], 2), float("-inf"), dtype=x.dtype, device=x.device)
    shift = _max_over_tp(local_max, tp_group)
    xc = x - shift[..., :1]
    yc = y - shift[..., 1:]
    ex = xc.exp()
    local = torch.stack([ex.sum(-1), (ex * (xc - yc)).sum(-1), yc.exp().sum(-1)], dim=-1)
    sum_exp_x, sum_ex_diff, sum_exp_y = _sum_over_tp(local, tp_group).unbind(-1)
    return sum_ex_diff / sum_exp_x - torch.log(sum_exp_x) + torch.log(sum_exp_y)
