"""Hugging Face <-> Megatron-Core weight mapping, per family, in both directions.

Each Megatron parameter has a *canonical full tensor*: the tensor a tp=1 model would hold, under
a global name (layer and expert numbers over the whole model). A `WeightMapping` says how the
canonical tensor is assembled from rows of HF tensors (`pieces`, along dim 0) and how it is split
over tensor parallelism (`tp_dim`, `tp_sub_chunks`, see `ShardMeta`). From that one table we get
  - loading: each rank reads exactly the HF rows/columns of its own shard (`read_shard`),
  - export: a full canonical tensor becomes HF tensors (`to_hf`), bit-exact.

Megatron layouts encoded here:
  linear_qkv: per query group g, [q heads of g; k_g; v_g] (rows), TP splits whole groups.
  linear_fc1 (gated MLP): [gate; up], each half split over TP -> two sub-chunks per shard.
  word embeddings / output layer: vocab rows padded with zeros to a multiple of tp.
  multi-latent attention (DeepSeek-V3): every projection is the HF tensor as it is; the q/kv down
    projections are column-parallel in Megatron's local spec (rows split over TP, output gathered),
    their norms are whole. The rope dims stay interleaved: Megatron's MLA de-interleaves them as
    transformers does with rope_interleave.
  router.expert_bias (a float32 buffer, not a parameter): HF's e_score_correction_bias.
Multi-token-prediction layers (`model.layers.{n}` for n >= num_hidden_layers) have no mapping: they
are skipped on load (`mtp_tensor_names`) and so never exported.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from megarl.models.families import ModelSpec
from megarl.models.sharding import ShardMeta


@dataclass(frozen=True)
class Piece:
    """`rows` consecutive rows of HF tensor `hf_name` starting at `hf_row_start`; None = zero padding."""

    hf_name: str | None
    rows: int
    hf_row_start: int = 0


@dataclass(frozen=True)
class WeightMapping:
    name: str  # global canonical Megatron name (local layer-spec naming)
    shape: tuple[int, ...]  # canonical full shape (tp = 1)
    pieces: tuple[Piece, ...]  # rows of the canonical tensor, in order
    tp_dim: int | None = None
    tp_sub_chunks: int = 1
    layer: int | None = None  # global layer index; None for embedding / final norm / output
    expert: int | None = None  # global expert index for routed-expert weights
    float32: bool = False  # kept in float32 whatever the model's dtype (the router's expert bias)

    def meta(self, tp_rank: int, tp_size: int) -> ShardMeta:
        return ShardMeta(self.shape, self.tp_dim, tp_rank, tp_size, self.tp_sub_chunks)

    @property
    def hf_names(self) -> list[str]:
        return list(dict.fromkeys(p.hf_name for p in self.pieces if p.hf_name is not None))


def _whole(hf_name: str, shape: tuple[int, ...], name: str, tp_dim=None, layer=None, expert=None) -> WeightMapping:
    return WeightMapping(name, shape, (Piece(hf_name, shape[0]),), tp_dim, 1, layer, expert)


def weight_mappings(spec: ModelSpec, tp: int) -> list[WeightMapping]:
    """Every Megatron parameter of the whole model, in a fixed global order (embedding first)."""
    h, d = spec.hidden_size, spec.head_dim
    vocab, padded = spec.vocab_size, spec.padded_vocab_size(tp)
    pad = (Piece(None, padded - vocab),) if padded > vocab else ()
    out = [
        WeightMapping("embedding.word_embeddings.weight", (padded, h), (Piece("model.embed_tokens.weight", vocab),) + pad, tp_dim=0)
    ]
    groups, q_per_group = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads
    for layer in range(spec.num_layers):
        hf, mc = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        qkv_rows = (spec.num_heads + 2 * groups) * d

        def qkv_pieces(suffix: str) -> tuple[Piece, ...]:
            pieces = []
            for g in range(groups):
                pieces += [
                    Piece(f"{hf}self_attn.q_proj.{suffix}", q_per_group * d, g * q_per_group * d),
                    Piece(f"{hf}self_attn.k_proj.{suffix}", d, g * d),
                    Piece(f"{hf}self_attn.v_proj.{suffix}", d, g * d),
                ]
            return tuple(pieces)

        out.append(_whole(f"{hf}input_layernorm.weight", (h,), f"{mc}input_layernorm.weight", layer=layer))
        if spec.mla is not None:
            out += _mla_mappings(spec, layer)
        else:
            out.append(WeightMapping(f"{mc}self_attention.linear_qkv.weight", (qkv_rows, h), qkv_pieces("weight"), 0, 1, layer))
            if spec.qkv_bias:
                out.append(WeightMapping(f"{mc}self_attention.linear_qkv.bias", (qkv_rows,), qkv_pieces("bias"), 0, 1, layer))
            if spec.qk_norm:
                out.append(_whole(f"{hf}self_attn.q_norm.weight", (d,), f"{mc}self_attention.q_layernorm.weight", layer=layer))
                out.append(_whole(f"{hf}self_attn.k_norm.weight", (d,), f"{mc}self_attention.k_layernorm.weight", layer=layer))
            out.append(_whole(f"{hf}self_attn.o_proj.weight", (h, spec.num_heads * d), f"{mc}self_attention.linear_proj.weight", 1, layer))
        out.append(_whole(f"{hf}post_attention_layernorm.weight", (h,), f"{mc}pre_mlp_layernorm.weight", layer=layer))
        if spec.is_moe_layer(layer):
            names, f = spec.hf_names, spec.moe_ffn_hidden_size
            block = f"{hf}{names.moe_block}."
            out.append(_whole(f"{block}{names.router}.weight", (spec.num_experts, h), f"{mc}mlp.router.weight", layer=layer))
            if spec.moe_expert_bias:
                out.append(WeightMapping(f"{mc}mlp.router.expert_bias", (spec.num_experts,),
                                         (Piece(f"{block}{names.router}.e_score_correction_bias", spec.num_experts),),
                                         layer=layer, float32=True))
            for e in range(spec.num_experts):
                ex, mex = f"{block}experts.{e}.", f"{mc}mlp.experts.local_experts.{e}."
                fc1 = (Piece(f"{ex}{names.expert_gate}.weight", f), Piece(f"{ex}{names.expert_up}.weight", f))
                out.append(WeightMapping(f"{mex}linear_fc1.weight", (2 * f, h), fc1, 0, 2, layer, e))
                out.append(_whole(f"{ex}{names.expert_down}.weight", (h, f), f"{mex}linear_fc2.weight", 1, layer, e))
            if spec.moe_shared_ffn_hidden_size:
                out += _gated_mlp(f"{block}shared_experts.", f"{mc}mlp.shared_experts.", h, spec.moe_shared_ffn_hidden_size, layer)
        else:
            out += _gated_mlp(f"{hf}mlp.", f"{mc}mlp.", h, spec.ffn_hidden_size, layer)
    out.append(_whole("model.norm.weight", (h,), "decoder.final_layernorm.weight"))
    lm_head = "model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight"
    out.append(WeightMapping("output_layer.weight", (padded, h), (Piece(lm_head, vocab),) + pad, tp_dim=0))
    return out


def _gated_mlp(hf: str, mc: str, h: int, f: int, layer: int) -> list[WeightMapping]:
    """A TP-split SwiGLU MLP (dense layers, shared experts): fc1 = [gate; up], fc2 = down."""
    fc1 = (Piece(f"{hf}gate_proj.weight", f), Piece(f"{hf}up_proj.weight", f))
    return [WeightMapping(f"{mc}linear_fc1.weight", (2 * f, h), fc1, 0, 2, layer),
            _whole(f"{hf}down_proj.weight", (h, f), f"{mc}linear_fc2.weight", 1, layer)]


def _mla_mappings(spec: ModelSpec, layer: int) -> list[WeightMapping]:
    """Multi-latent attention of one layer (local-spec names; TE's fused norms map onto them)."""
    mla, h, heads = spec.mla, spec.hidden_size, spec.num_heads
    hf, mc = f"model.layers.{layer}.self_attn.", f"decoder.layers.{layer}.self_attention."
    q_rows = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    out = []
    if mla.q_lora_rank is None:
        out.append(_whole(f"{hf}q_proj.weight", (q_rows, h), f"{mc}linear_q_proj.weight", 0, layer))
    else:
        out += [_whole(f"{hf}q_a_proj.weight", (mla.q_lora_rank, h), f"{mc}linear_q_down_proj.weight", 0, layer),
                _whole(f"{hf}q_a_layernorm.weight", (mla.q_lora_rank,), f"{mc}q_layernorm.weight", layer=layer),
                _whole(f"{hf}q_b_proj.weight", (q_rows, mla.q_lora_rank), f"{mc}linear_q_up_proj.weight", 0, layer)]
    kv_down = mla.kv_lora_rank + mla.qk_rope_head_dim  # [latent; shared rope key], as in HF
    kv_up = heads * (mla.qk_nope_head_dim + mla.v_head_dim)  # per head [k_nope; v], as in HF
    out += [_whole(f"{hf}kv_a_proj_with_mqa.weight", (kv_down, h), f"{mc}linear_kv_down_proj.weight", 0, layer),
            _whole(f"{hf}kv_a_layernorm.weight", (mla.kv_lora_rank,), f"{mc}kv_layernorm.weight", layer=layer),
            _whole(f"{hf}kv_b_proj.weight", (kv_up, mla.kv_lora_rank), f"{mc}linear_kv_up_proj.weight", 0, layer),
            _whole(f"{hf}o_proj.weight", (h, heads * mla.v_head_dim), f"{mc}linear_proj.weight", 1, layer)]
    return out


_MTP_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_tensor_names(spec: ModelSpec, hf_names) -> list[str]:
    """Checkpoint tensors of multi-token-prediction layers (layer number >= num_hidden_layers):
    not part of the causal LM, so never loaded and never exported."""
    return [n for n in hf_names if (m := _MTP_LAYER.match(n)) and int(m.group(1)) >= spec.num_layers]


def exported_mappings(spec: ModelSpec, tp: int, lm_head: bool = True) -> list[WeightMapping]:
    """Mappings that produce HF tensors on export. A tied output layer repeats the embedding, and
    a critic (`lm_head=False`) has a value head instead, so neither exports `lm_head.weight`."""
    maps = weight_mappings(spec, tp)
    return maps[:-1] if spec.tie_embeddings or not lm_head else maps


# --- export: canonical full tensor -> HF tensors --------------------------------------------------


def to_hf(mapping: WeightMapping, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Split a canonical full tensor into its HF tensors (padding rows dropped)."""
    parts: dict[str, list[torch.Tensor]] = {}
    row = 0
    for piece in mapping.pieces:
        if piece.hf_name is not None:
            parts.setdefault(piece.hf_name, []).append(full.narrow(0, row, piece.rows))
        row += piece.rows
    return [(name, torch.cat(chunks, 0) if len(chunks) > 1 else chunks[0].clone()) for name, chunks in parts.items()]


# --- loading: HF rows -> this rank's shard -----------------------------------------------------------


def shard_row_ranges(mapping: WeightMapping, tp_rank: int, tp_size: int) -> list[tuple[int, int]]:
    """Canonical row ranges [start, end) that form this rank's shard along dim 0, in order."""
    n = mapping.shape[0]
    if mapping.tp_dim != 0 or tp_size == 1:
        return [(0, n)]
    block = n // mapping.tp_sub_chunks
    per_rank = block // tp_size
    return [(j * block + tp_rank * per_rank, j * block + (tp_rank + 1) * per_rank) for j in range(mapping.tp_sub_chunks)]


ReadSlice = Callable[[str, slice, slice | None], torch.Tensor]


def read_shard(mapping: WeightMapping, tp_rank: int, tp_size: int, read: ReadSlice, dtype: torch.dtype) -> torch.Tensor:
    """Assemble this rank's shard from HF tensors, reading only the rows/columns it needs.

    `read(hf_name, rows, cols)` returns that slice of an HF tensor (cols None = all columns).
    """
    cols = None
    if mapping.tp_dim == 1 and tp_size > 1:
        width = mapping.shape[1] // tp_size
        cols = slice(tp_rank * width, (tp_rank + 1) * width)
    chunks = []
    starts, row = [], 0
    for piece in mapping.pieces:
        starts.append(row)
        row += piece.rows
    for lo, hi in shard_row_ranges(mapping, tp_rank, tp_size):
        for piece, start in zip(mapping.pieces, starts):
            a, b = max(lo, start), min(hi, start + piece.rows)
            if a >= b:
                continue
            if piece.hf_name is None:
                shape = (b - a,) + tuple(mapping.shape[1:])
                if cols is not None:
                    shape = (b - a, cols.stop - cols.start) + tuple(mapping.shape[2:])
                chunks.append(torch.zeros(shape, dtype=dtype))
            else:
                hf_rows = slice(piece.hf_row_start + a - start, piece.hf_row_start + b - start)
                chunks.append(read(piece.hf_name, hf_rows, cols).to(dtype))
    return torch.cat(chunks, 0) if len(chunks) > 1 else chunks[0]


def iter_hf_tensors(mappings: list[WeightMapping], fulls: Iterator[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    for mapping, full in zip(mappings, fulls):
        yield from to_hf(mapping, full)
