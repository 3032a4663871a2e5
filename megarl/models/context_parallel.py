"""Context parallelism (`parallel.cp`) for packed (`thd`) micro-batches: the token split and megarl's
own CP core attention, for every path without Transformer-Engine.

**The split** (Megatron's and TE's load-balanced convention, `thd_get_partitioned_indices`): every
segment of the packed row (a sequence padded at its end to a multiple of 2*cp, or a pad segment)
is cut into 2*cp equal chunks of c tokens, and CP rank r keeps chunks r and 2*cp-1-r, in that
order. Causal attention then costs every rank the same: its queries see (r+1)*c + (2*cp-r)*c keys.

**The attention** all-gathers K and V over the CP group (TE's `all_gather` mode; exact, no
log-sum-exp merging, which public SDPA does not return) and attends each local query chunk to its
sequence's keys up to its own position. The gathered K/V are *not* kept for backward: the autograd
function saves only this rank's q, k, v (O(S/cp) per layer) and gathers again in backward, where
the gradients of the gathered K/V are reduce-scattered (summed) back to the ranks that own them.
One more all-gather per layer buys the memory: a 70B model at 64k tokens would otherwise keep
20 GiB of gathered K/V for backward (docs/long_context.md).

With Transformer-Engine present, Megatron's `TEDotProductAttention` runs its own CP (p2p ring) on
the same layout: `cu_seqlens_q_padded` = the padded global boundaries, tokens split as here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


def cp_index(cu_padded, cp: int, rank: int) -> torch.Tensor:
    """Global token indices held by CP rank `rank`, in local order (TE's thd_get_partitioned_indices).

    cu_padded: segment boundaries (each segment length a multiple of 2*cp)."""
    bounds = [int(x) for x in cu_padded]
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        if length % (2 * cp):
            raise ValueError(f"segment [{start}, {end}) of length {length} is not a multiple of 2*cp = {2 * cp}")
        c = length // (2 * cp)
        pieces.append(torch.arange(start + rank * c, start + (rank + 1) * c))
        pieces.append(torch.arange(start + (2 * cp - 1 - rank) * c, start + (2 * cp - rank) * c))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def gathered_order(cu_padded, cp: int) -> torch.Tensor:
    """Where global token t sits in the rank-major all-gather of every rank's local tokens."""
    order = torch.cat([cp_index(cu_padded, cp, r) for r in range(cp)])
    where = torch.empty_like(order)
    where[order] = torch.arange(len(order))
    return where


@dataclass(frozen=True)
class CPPlan:
    """One micro-batch's CP attention as index tensors, the same for every layer (cached on the
    PackedSeqParams, as `packed_attention.length_groups` is).

    groups: per distinct segment length L and per local chunk (global chunk k = r, then 2*cp-1-r),
    (local query rows [n, c], gathered key rows [n, (k+1)*c], allowed [c, (k+1)*c]): each chunk
    attends only to the keys up to its own end (5c^2 score entries per rank at cp2, not 2c x 4c)."""

    cp: int
    rank: int
    local_tokens: int
    groups: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]


_CACHE = "_megarl_cp_plan"


def cp_plan(packed_seq_params, cp: int, rank: int, device: torch.device) -> CPPlan:
    cached = getattr(packed_seq_params, _CACHE, None)
    if cached is not None and (cached.cp, cached.rank) == (cp, rank):
        return cached
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    bounds = [int(x) for x in cu]
    where = gathered_order(bounds, cp).to(device)
    by_length: dict[int, list[tuple[int, int]]] = {}
    local = 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        by_length.setdefault(end - start, []).append((start, local))
        local += (end - start) // cp
    groups = []
    for length, members in sorted(by_length.items()):
        c = length // (2 * cp)
        starts = torch.tensor([s for s, _ in members], device=device)
        locals_ = torch.tensor([l for _, l in members], device=device)
        for j, chunk in enumerate((rank, 2 * cp - 1 - rank)):  # local chunk j holds global chunk `chunk`
            keys = (chunk + 1) * c
            q_rows = locals_.unsqueeze(1) + j * c + torch.arange(c, device=device)  # [n, c]
            k_rows = where[starts.unsqueeze(1) + torch.arange(keys, device=device)]  # [n, keys] in the gathered tensor
            q_pos = torch.arange(chunk * c, keys)
            allowed = (torch.arange(keys).unsqueeze(0) <= q_pos.unsqueeze(1)).to(device)  # [c, keys]: causal, by position
            groups.append((q_rows, k_rows, allowed))
    plan = CPPlan(cp, rank, local, tuple(groups))
    setattr(packed_seq_params, _CACHE, plan)
    return plan


def _attend(plan: CPPlan, q, k_all, v_all, heads: int, groups: int, scale: float) -> torch.Tensor:
    """q [T, heads, dk] (local), k_all/v_all [cp*T, groups, d] (gathered, rank-major) -> [T, heads*dv]."""
    out = q.new_zeros(q.shape[0], heads * v_all.shape[-1])
    repeat = heads // groups
    for q_rows, k_rows, allowed in plan.groups:
        qg = q[q_rows].permute(0, 2, 1, 3)  # [n, heads, c, dk]
        kg, vg = (t[k_rows].permute(0, 2, 1, 3) for t in (k_all, v_all))  # [n, groups, keys, d]
        if repeat > 1:
            kg, vg = (t.repeat_interleave(repeat, dim=1) for t in (kg, vg))
        ctx = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=allowed, scale=scale)  # [n, heads, c, dv]
        out = out.index_put((q_rows.reshape(-1),), ctx.permute(0, 2, 1, 3).reshape(-1, heads * v_all.shape[-1]))
    return out


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty(x.shape[0] // dist.get_world_size(group), *x.shape[1:])
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class _GatheredKVAttention(torch.autograd.Function):
    """Exact causal attention of local queries against the all-gathered K/V; saves local tensors only."""

    @staticmethod
    def forward(ctx, q, k, v, plan, group, heads, groups, scale):  # noqa: D102
        ctx.plan, ctx.group, ctx.heads, ctx.groups, ctx.scale = plan, group, heads, groups, scale
        ctx.save_for_backward(q, k, v)
        return _attend(plan, q, _all_gather(k, group), _all_gather(v, group), heads, groups, scale)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        q, k, v = ctx.saved_tensors
        # Gather again instead of having kept the gathered K/V since forward: memory stays O(S/cp).
        k_all, v_all = (_all_gather(t, ctx.group).requires_grad_() for t in (k, v))
        with torch.enable_grad():
            q_ = q.detach().requires_grad_()
            out = _attend(ctx.plan, q_, k_all, v_all, ctx.heads, ctx.groups, ctx.scale)
            dq, dk_all, dv_all = torch.autograd.grad(out, (q_, k_all, v_all), grad)
        # Every rank's queries touched every rank's keys: sum those gradients on the owners.
        return dq, _reduce_scatter(dk_all, ctx.group), _reduce_scatter(dv_all, ctx.group), None, None, None, None, None


def cp_attention(query, key, value, packed_seq_params, group, heads: int, groups: int, scale: float) -> torch.Tensor:
    """Causal self-attention of this CP rank's `thd` tokens ([T, heads, dk], [T, groups, dk],
    [T, groups, dv]) over whole sequences; returns [T, heads * dv] in local order."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = cp_plan(packed_seq_params, cp, rank, query.device)
    if plan.local_tokens != query.shape[0]:
        raise ValueError(f"context parallelism: {query.shape[0]} local tokens, the packed boundaries give "
                         f"{plan.local_tokens} (micro-batches must be split by megarl.engine.context_parallel)")
    return _GatheredKVAttention.apply(query, key, value, plan, group, heads, groups, scale)
