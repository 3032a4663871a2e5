"""Core attention on `torch.nn.functional.scaled_dot_product_attention`, for every path without
Transformer Engine (CPU, and GPUs whose PyTorch image has no TE).

Megatron-Core's local `DotProductAttention` materialises the scores (`baddbmm`, `masked_fill`,
`softmax`, `bmm`): about 10x the time of SDPA on the same shapes on CPU, and no flash or
memory-efficient kernel on GPU. This module is a drop-in `core_attention` for Megatron's
`SelfAttention` and `MLASelfAttention`:
- padded micro-batches `[s, b, heads, dim]`, causal (right padding never reaches a real token) or
  with Megatron's boolean mask (True = masked out);
- packed micro-batches (`thd`, `PackedSeqParams`), by the length groups of
  `megarl.models.packed_attention.attend_packed`;
- grouped-query attention, and query/key head size different from the value head size (what
  multi-latent attention passes as `k_channels` / `v_channels`).
- context parallelism (`parallel.cp`, packed only): `megarl.models.context_parallel.cp_attention`.
Variants the families do not use (sliding windows, learnable softmax offsets) are refused with an
error instead of being computed differently from transformers.
"""
from __future__ import annotations

import math

from megatron.core import parallel_state
import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from megarl.models.context_parallel import cp_attention
from megarl.models.packed_attention import attend_packed


class SDPACoreAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None,
                 k_channels: int | None = None, v_channels: int | None = None):
        super().__init__(config=config)
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, max(1, layer_number)):
            raise ValueError("sliding-window attention is not supported by megarl's SDPA core attention")
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} is not supported by megarl's SDPA core attention")
        if pg_collection is not None:
            tp = pg_collection.tp.size()
        else:
            tp = parallel_state.get_tensor_model_parallel_world_size()
        if config.num_attention_heads % tp or config.num_query_groups % tp:
            raise ValueError(f"{config.num_attention_heads} heads / {config.num_query_groups} groups do not split over tp={tp}")
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        # apply_query_key_layer_scaling divides the scale by the layer number and Megatron's softmax
        # multiplies it back (an fp16 overflow guard): the probabilities are the same, so ignore it.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.attn_mask_type = attn_mask_type
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp = config.context_parallel_size
        if self.cp > 1:
            if self.dropout:
                raise ValueError("attention dropout under context parallelism is not supported by megarl's CP attention")
            if pg_collection is not None:
                self.cp_group = pg_collection.cp
            else:
                self.cp_group = parallel_state.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by megarl's SDPA core attention")
        mask_type = attn_mask_type or self.attn_mask_type
        if self.cp > 1:
            if packed_seq_params is None or attention_mask is not None or "causal" not in mask_type.name:
                raise ValueError("context parallelism runs on packed (thd) causal micro-batches only: model.sequence_packing=true")

            return cp_attention(query, key, value, packed_seq_params, self.cp_group, self.heads, self.groups, self.softmax_scale)
        if packed_seq_params is not None:
            if attention_mask is not None:
                raise ValueError("packed (thd) sequences take their boundaries from cu_seqlens, not an attention mask")
            # Each length group is a right-padded batch; causal attention keeps the pads out.
            return attend_packed(query, key, value, packed_seq_params,
                                 lambda q, k, v: self.attend_padded(q, k, v, None, mask_type))
        return self.attend_padded(query, key, value, attention_mask, mask_type)

    def attend_padded(self, query, key, value, attention_mask, mask_type) -> torch.Tensor:
        """[sq, b, heads, dk], [sk, b, groups, dk], [sk, b, groups, dv] -> [sq, b, heads * dv]."""
        sq, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        gqa = {}
        if self.heads != self.groups:
            if attention_mask is None and self.k_channels == self.v_channels:
                # The flash kernels (CPU and CUDA) read grouped K/V in place: no expanded copy, and
                # no reduction of its gradient over the repeats in backward.
                gqa = {"enable_gqa": True}
            else:
                # With a mask (CUDA: memory-efficient kernel) or unequal head sizes flash is out and
                # the other kernels refuse enable_gqa: expand K/V to keep them eligible.
                repeat = self.heads // self.groups
                k, v = (t.repeat_interleave(repeat, dim=1) for t in (k, v))
        mask, causal = None, mask_type == AttnMaskType.causal
        if attention_mask is not None:  # Megatron's convention: True = masked out
            mask, causal = ~attention_mask.bool(), False
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                 dropout_p=self.dropout if self.training else 0.0,
                                                 scale=self.softmax_scale, **gqa)
        # value's own head size: Megatron-Core 0.19's MLA pads V to the query's head size for packed
        # (thd) input and trims the [tokens, heads * padded] output itself
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.heads * v.shape[-1])
