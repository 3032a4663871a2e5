"""Core attention for packed (`thd`) sequences without Transformer Engine.

Megatron-Core runs packed sequences (padding removed: the micro-batch's sequences laid end to end
in one row, their boundaries in `PackedSeqParams.cu_seqlens_q`) through the whole model: RoPE
restarts at every boundary (`rope_utils._apply_rotary_pos_emb_thd`), and the MLPs, norms and
MoE routing are per-token anyway. Only the core attention must not look across a boundary, and
Megatron's own local `DotProductAttention` refuses `thd` input (TE's fused kernels handle it on
GPU). This subclass runs Megatron's attention once per sequence, so packed results are the padded
results' math exactly, and no attention is spent on padding or across sequences.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PackedDotProductAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences in format {packed_seq_params.qkv_format!r}: only 'thd' is supported")
        if packed_seq_params.cu_seqlens_q_padded is not None or packed_seq_params.cu_seqlens_kv_padded is not None:
            raise ValueError("padded cu_seqlens (context parallelism) are not supported by the local attention")
        # thd tensors are [tokens, heads, head_dim]; the parent wants [seq, batch=1, heads, head_dim].
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        if packed_seq_params.cu_seqlens_kv.tolist() != bounds:
            raise ValueError("self-attention on packed sequences needs cu_seqlens_kv == cu_seqlens_q")
        outputs = [
            # attention_mask None: the parent's softmax builds the causal mask of this sequence.
            super(PackedDotProductAttention, self).forward(
                query[start:end].unsqueeze(1), key[start:end].unsqueeze(1), value[start:end].unsqueeze(1),
                None, attn_mask_type, attention_bias,
            )
            for start, end in zip(bounds[:-1], bounds[1:])
            if end > start
        ]
        return torch.cat(outputs, dim=0).squeeze(1)  # [tokens, heads * head_dim]
