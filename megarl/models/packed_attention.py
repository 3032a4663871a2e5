"""Core attention for packed (`thd`) sequences without Transformer Engine.

Megatron-Core runs packed sequences (padding removed: the micro-batch's sequences laid end to end
in one row, their boundaries in `PackedSeqParams.cu_seqlens_q`) through the whole model: RoPE
restarts at every boundary (`rope_utils._apply_rotary_pos_emb_thd`), and the MLPs, norms and
MoE routing are per-token anyway. Only the core attention must not look across a boundary, and
Megatron's own local `DotProductAttention` refuses `thd` input (TE's fused kernels handle it on
GPU). `attend_packed` lays sequences of similar length (within a factor of two) side by side as a
right-padded batch and runs a padded attention once per such group (megarl's SDPA core
attention, or Megatron's own in `PackedDotProductAttention`): the math of the padded
layout (causal, so a sequence's own padding never reaches its tokens), at most twice the length of
padding inside the attention and at most ~log2(longest) calls, while every other layer sees no
padding at all. The groups are computed once per micro-batch (`length_groups`), not per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PackedDotProductAttention(DotProductAttention):
    """Megatron's local attention extended to `thd` input (the reference `SDPACoreAttention` is checked against)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        # attention_mask None: the parent's softmax builds the causal mask.
        return attend_packed(query, key, value, packed_seq_params,
                             lambda q, k, v: super(PackedDotProductAttention, self).forward(q, k, v, None, attn_mask_type, attention_bias))


@dataclass(frozen=True)
class LengthGroups:
    """One micro-batch's packing as index tensors: the same for every layer of the model.

    Computing it costs several device-to-host syncs (`unique().tolist()`, `int(...)` of lengths),
    so `length_groups` computes it once per micro-batch and keeps it on the PackedSeqParams object
    every layer receives (recomputation in backward reuses it too).
    """

    device: torch.device
    n_tokens: int
    equal: tuple[int, int] | None  # (segments, length) when every segment is equally long: a reshape
    groups: tuple[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], tuple[int, int]], ...]  # (tokens, where, shape)
    order: torch.Tensor | None  # [tokens] pack order of the concatenated group outputs


_CACHE = "_megarl_length_groups"


def length_groups(packed_seq_params, n_tokens: int, device: torch.device) -> LengthGroups:
    """The micro-batch's LengthGroups, computed on first use and cached on `packed_seq_params`."""
    cached = getattr(packed_seq_params, _CACHE, None)
    if cached is not None and cached.device == device and cached.n_tokens == n_tokens:
        return cached
    found = _compute_length_groups(packed_seq_params, n_tokens, device)
    setattr(packed_seq_params, _CACHE, found)
    return found


def _compute_length_groups(packed_seq_params, n_tokens: int, device: torch.device) -> LengthGroups:
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(f"packed sequences in format {packed_seq_params.qkv_format!r}: only 'thd' is supported")
    if packed_seq_params.cu_seqlens_q_padded is not None or packed_seq_params.cu_seqlens_kv_padded is not None:
        raise ValueError("padded cu_seqlens (context parallelism) are not supported by the local attention")
    cu = packed_seq_params.cu_seqlens_q
    if not torch.equal(cu, packed_seq_params.cu_seqlens_kv):
        raise ValueError("self-attention on packed sequences needs cu_seqlens_kv == cu_seqlens_q")
    # Token i of the pack is position pos[i] of segment seg[i]; a group's batch is
    # [its longest segment, its segments, heads, head_dim].
    lens = (cu[1:] - cu[:-1]).long().to(device)
    seg = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)
    pos = torch.arange(n_tokens, device=device) - cu[:-1].long().to(device)[seg]
    group_of_seg = torch.log2(lens.clamp_min(1).double()).floor().long()
    groups = group_of_seg.unique().tolist()
    if len(groups) == 1 and int(lens.min()) == int(lens.max()):
        return LengthGroups(device, n_tokens, (len(lens), int(lens[0])), (), None)
    found, order = [], []
    for group in groups:
        members = (group_of_seg == group).nonzero().squeeze(1)
        slot = torch.full_like(lens, -1)
        slot[members] = torch.arange(len(members), device=device)
        tokens = (group_of_seg[seg] == group).nonzero().squeeze(1)
        where = (pos[tokens], slot[seg[tokens]])
        found.append((tokens, where, (int(lens[members].max()), len(members))))
        order.append(tokens)
    return LengthGroups(device, n_tokens, None, tuple(found), torch.argsort(torch.cat(order)))


def attend_packed(query, key, value, packed_seq_params, attend_padded) -> torch.Tensor:
    """Causal self-attention of `thd` tensors ([tokens, heads, head_dim]) by length groups.

    `attend_padded(q, k, v)` is a causal attention of right-padded [length, batch, heads, dim]
    tensors returning [length, batch, heads * value_dim]; it runs once per group.
    Returns [tokens, heads * value_dim] in pack order.
    """
    lg = length_groups(packed_seq_params, query.shape[0], query.device)
    if lg.equal is not None:
        # Equal lengths (one sequence, or equal-length segments): a reshape, no gather/scatter.
        n, length = lg.equal
        q, k, v = (t.reshape(n, length, *t.shape[1:]).transpose(0, 1) for t in (query, key, value))
        return attend_padded(q, k, v).transpose(0, 1).reshape(query.shape[0], -1)
    pieces = []
    for tokens, where, shape in lg.groups:
        q, k, v = (_right_padded(t[tokens], where, shape) for t in (query, key, value))
        pieces.append(attend_padded(q, k, v)[where])
    return torch.cat(pieces)[lg.order]  # [tokens, heads * value_dim], pack order


def _right_padded(rows: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """[length, sequences, ...] zeros with `rows` placed at (position, sequence) = where."""
    out = rows.new_zeros(*shape, *rows.shape[1:])
    out[where] = rows
    return out
