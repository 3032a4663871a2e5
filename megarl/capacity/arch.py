"""A model's tensors, parameter counts and FLOPs, from its Hugging Face `config.json` alone, parsed
by the model builder's parser (`megarl.models.families.spec_from_hf_config`: one reading of a
config.json for the trainer and the planner).

Covers megarl's families (`megarl.models.families.FAMILY_NAMES`), among them the 355B-671B MoE class
megarl does not train yet: DeepSeek-V3 (`deepseek_v3`: multi-latent attention, shared experts,
dense first layers, an MTP layer) and GLM-4.5 (`glm4_moe`). Tensors are listed the way
Megatron-Core holds them (fused QKV, fused gate/up fc1), each tagged with how tensor parallelism
splits it:
- "tp": split over the TP ranks (column- or row-parallel weights, the vocabulary);
- "rep": replicated on every TP rank (norms, routers, MLA's down-projections);
- "expert": one routed expert's weight; a layer holds `count` of them, spread over EP ranks and
  split over expert-TP ranks.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

from megarl.layout import ModelShape, stage_layers  # noqa: F401  (stage_layers: re-exported for the planner)
from megarl.layout.model import padded_vocab
from megarl.models.families import FAMILIES, ModelSpec, read_hf_config, spec_from_hf_config

SUPPORTED = tuple(FAMILIES)


@dataclass(frozen=True)
class Tensor:
    name: str
    numel: int  # of one copy (one expert for "expert")
    split: str  # "tp" | "rep" | "expert"
    count: int = 1  # experts per layer for "expert"
    matmul: bool = True  # a weight multiplied by every token routed to it (not a norm, bias or lookup)


@dataclass(frozen=True)
class Arch:
    """Layout-independent sizes. `experts` = 0 for dense models."""

    model_type: str
    hidden: int
    num_layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense MLP width
    tie_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    # multi-latent attention (DeepSeek); q_lora_rank None = a plain q projection
    mla: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # mixture of experts
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    shared_experts: int = 0  # each moe_ffn wide
    first_dense_layers: int = 0  # DeepSeek/GLM first_k_dense_replace
    router_bias: bool = False  # sigmoid routing's e_score_correction_bias
    mtp_layers: int = 0  # num_nextn_predict_layers (not trained by RL recipes; counted apart)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def q_dim(self) -> int:
        """Width of the attention output (input of the output projection)."""
        return self.heads * (self.v_head_dim if self.mla else self.head_dim)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.first_dense_layers

    @property
    def shape(self) -> ModelShape:
        """What the layout rules read (megarl.layout.check_model)."""
        return ModelShape(name=self.model_type, num_layers=self.num_layers, heads=self.heads, kv_heads=self.kv_heads,
                          ffn=self.ffn, tie_embeddings=self.tie_embeddings, experts=self.experts, moe_ffn=self.moe_ffn,
                          shared_ffn=self.shared_experts * self.moe_ffn,
                          mla_kv_rows=self.kv_lora_rank + self.qk_rope_head_dim if self.mla else None,
                          q_lora_rank=self.q_lora_rank if self.mla else None)

    def padded_vocab(self, tp: int) -> int:
        """Megatron's embedding rows (megarl.models.families.ModelSpec.padded_vocab_size)."""
        return padded_vocab(self.vocab, tp)

    def kv_cache_bytes_per_token(self, rollout_tp: int, dtype_bytes: int = 2) -> int:
        """KV cache one token takes on one rollout GPU: K and V of this GPU's kv heads in every
        layer (heads are replicated when rollout_tp exceeds them); MLA caches one latent
        (kv_lora_rank + rope dims) per layer, replicated on every TP rank (vLLM)."""
        if self.mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        heads_here = max(1, self.kv_heads // rollout_tp)
        return self.num_layers * 2 * heads_here * self.head_dim * dtype_bytes


def load_config(path: str | Path) -> dict:
    """A HF config.json (or a directory holding one) as a dict; ValueError naming the problem
    (megarl.models.families.read_hf_config, the model builder's reader)."""
    return read_hf_config(path)


def arch_from_config(cfg: dict) -> Arch:
    """Read the sizes of a supported family with the model builder's parser
    (megarl.models.families.spec_from_hf_config); ValueError naming a missing key or the family."""
    return arch_from_spec(spec_from_hf_config(cfg))


def arch_from_spec(spec: ModelSpec) -> Arch:
    """The planner's view of a ModelSpec."""
    mla = spec.mla
    common = dict(model_type=spec.family, hidden=spec.hidden_size, num_layers=spec.num_layers, vocab=spec.vocab_size,
                  heads=spec.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, ffn=spec.ffn_hidden_size,
                  tie_embeddings=spec.tie_embeddings, qkv_bias=spec.qkv_bias, qk_norm=spec.qk_norm)
    if mla is not None:
        common.update(mla=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
                      qk_nope_head_dim=mla.qk_nope_head_dim, qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim)
    if spec.is_moe:
        common.update(experts=spec.num_experts, topk=spec.moe_topk, moe_ffn=spec.moe_ffn_hidden_size,
                      shared_experts=(spec.moe_shared_ffn_hidden_size or 0) // spec.moe_ffn_hidden_size,
                      first_dense_layers=spec.moe_first_dense_layers, router_bias=spec.moe_expert_bias,
                      mtp_layers=spec.mtp_layers)
    return Arch(**common)


def attention_tensors(a: Arch) -> list[Tensor]:
    h = a.hidden
    if a.mla:
        q_out = a.heads * a.qk_head_dim
        out = [Tensor("input_layernorm", h, "rep", matmul=False)]
        if a.q_lora_rank:
            out += [Tensor("q_down_proj", a.q_lora_rank * h, "rep"), Tensor("q_layernorm", a.q_lora_rank, "rep", matmul=False),
                    Tensor("q_up_proj", q_out * a.q_lora_rank, "tp")]
        else:
            out.append(Tensor("q_proj", q_out * h, "tp"))
        out += [Tensor("kv_down_proj", (a.kv_lora_rank + a.qk_rope_head_dim) * h, "rep"),
                Tensor("kv_layernorm", a.kv_lora_rank, "rep", matmul=False),
                Tensor("kv_up_proj", a.heads * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank, "tp"),
                Tensor("linear_proj", h * a.q_dim, "tp")]
        return out
    qkv = (a.heads + 2 * a.kv_heads) * a.head_dim
    out = [Tensor("input_layernorm", h, "rep", matmul=False), Tensor("linear_qkv", qkv * h, "tp")]
    if a.qkv_bias:
        out.append(Tensor("linear_qkv_bias", qkv, "tp", matmul=False))
    if a.qk_norm:
        out += [Tensor("q_layernorm", a.head_dim, "rep", matmul=False), Tensor("k_layernorm", a.head_dim, "rep", matmul=False)]
    out.append(Tensor("linear_proj", h * a.q_dim, "tp"))
    return out


def mlp_tensors(a: Arch, layer: int) -> list[Tensor]:
    h = a.hidden
    out = [Tensor("pre_mlp_layernorm", h, "rep", matmul=False)]
    if not a.is_moe_layer(layer):
        return out + [Tensor("linear_fc1", 2 * a.ffn * h, "tp"), Tensor("linear_fc2", h * a.ffn, "tp")]
    out.append(Tensor("router", a.experts * h, "rep"))
    if a.router_bias:
        out.append(Tensor("router_expert_bias", a.experts, "rep", matmul=False))
    out += [Tensor("expert_fc1", 2 * a.moe_ffn * h, "expert", a.experts), Tensor("expert_fc2", h * a.moe_ffn, "expert", a.experts)]
    if a.shared_experts:
        s = a.shared_experts * a.moe_ffn
        out += [Tensor("shared_fc1", 2 * s * h, "tp"), Tensor("shared_fc2", h * s, "tp")]
    return out


def _adapter(name: str, inp: int, out: int, rank: int, kind: str, experts: int = 0) -> list[Tensor]:
    """One projection's LoRA factors A [rank, in], B [out, rank], split as megarl.models.lora splits
    them: a column-parallel layer's B and a row-parallel layer's A over TP, the other factor
    replicated; expert factors with their experts (the replicated one counted split: a few KiB)."""
    if experts:
        return [Tensor(f"{name}.lora", rank * (inp + out), "expert", experts)]
    a_split, b_split = ("rep", "tp") if kind == "column" else ("tp", "rep")
    return [Tensor(f"{name}.lora_A", rank * inp, a_split), Tensor(f"{name}.lora_B", rank * out, b_split)]


def lora_tensors(a: Arch, layer: int, rank: int) -> list[Tensor]:
    """The adapters of one decoder layer with every linear layer targeted (actor.lora's default)."""
    h, out = a.hidden, []
    if a.mla:
        q_out = a.heads * a.qk_head_dim
        if a.q_lora_rank:
            out += _adapter("q_a_proj", h, a.q_lora_rank, rank, "column") + _adapter("q_b_proj", a.q_lora_rank, q_out, rank, "column")
        else:
            out += _adapter("q_proj", h, q_out, rank, "column")
        out += _adapter("kv_a_proj_with_mqa", h, a.kv_lora_rank + a.qk_rope_head_dim, rank, "column")
        out += _adapter("kv_b_proj", a.kv_lora_rank, a.heads * (a.qk_nope_head_dim + a.v_head_dim), rank, "column")
    else:
        out += _adapter("q_proj", h, a.heads * a.head_dim, rank, "column")
        out += 2 * _adapter("kv_proj", h, a.kv_heads * a.head_dim, rank, "column")
    out += _adapter("o_proj", a.q_dim, h, rank, "row")

    def mlp(name: str, f: int, experts: int = 0) -> list[Tensor]:
        return (2 * _adapter(f"{name}.gate_up", h, f, rank, "column", experts)
                + _adapter(f"{name}.down_proj", f, h, rank, "row", experts))

    if not a.is_moe_layer(layer):
        return out + mlp("mlp", a.ffn)
    out += mlp("experts", a.moe_ffn, a.experts)
    if a.shared_experts:
        out += mlp("shared_experts", a.shared_experts * a.moe_ffn)
    return out


@functools.lru_cache(maxsize=4096)
def layer_tensors(a: Arch, layer: int) -> tuple[Tensor, ...]:
    return tuple(attention_tensors(a) + mlp_tensors(a, layer))


def embedding_tensor(a: Arch, tp: int = 1) -> Tensor:
    return Tensor("word_embeddings", a.padded_vocab(tp) * a.hidden, "tp", matmul=False)  # a lookup, no FLOPs


def head_tensors(a: Arch, tp: int = 1, critic: bool = False) -> list[Tensor]:
    """The last stage's final norm and LM head (or the critic's replicated value head)."""
    out = [Tensor("final_layernorm", a.hidden, "rep", matmul=False)]
    if critic:
        return out + [Tensor("value_head", a.hidden, "rep"), Tensor("value_head_bias", 1, "rep", matmul=False)]
    return out + [Tensor("output_layer", a.padded_vocab(tp) * a.hidden, "tp")]


def mtp_tensors(a: Arch) -> list[Tensor]:
    """One DeepSeek-style MTP module without its shared embedding and head: enorm, hnorm, the
    2h -> h projection, a full decoder layer and its shared-head norm."""
    h = a.hidden
    return [Tensor("mtp_enorm", h, "rep", matmul=False), Tensor("mtp_hnorm", h, "rep", matmul=False),
            Tensor("mtp_eh_proj", 2 * h * h, "tp"), *layer_tensors(a, a.num_layers), Tensor("mtp_head_norm", h, "rep", matmul=False)]


def _numel(ts: list[Tensor]) -> int:
    return sum(t.numel * t.count for t in ts)


def params_total(a: Arch) -> int:
    """Parameters of the main model as Hugging Face counts them (unpadded vocabulary, no MTP)."""
    n = a.vocab * a.hidden * (1 if a.tie_embeddings else 2) + a.hidden
    return n + sum(_numel(layer_tensors(a, i)) for i in range(a.num_layers))


def params_mtp(a: Arch) -> int:
    return a.mtp_layers * _numel(mtp_tensors(a))


def matmul_params_per_token(a: Arch, critic: bool = False) -> int:
    """Weights each token is multiplied by: routed experts count top-k times, the LM head counts
    (tied or not), the input-embedding lookup and norms do not."""
    n = 0
    for i in range(a.num_layers):
        for t in layer_tensors(a, i):
            if t.matmul:
                n += t.numel * (a.topk if t.split == "expert" else 1)
    return n + (a.hidden if critic else a.vocab * a.hidden)


def params_active(a: Arch) -> int:
    """Parameters touched per token (embedding row and norms included, unrouted experts not)."""
    n = a.vocab * a.hidden * (1 if a.tie_embeddings else 2) + a.hidden
    for i in range(a.num_layers):
        for t in layer_tensors(a, i):
            n += t.numel * (a.topk if t.split == "expert" else 1)
    return n


def forward_flops_per_token(a: Arch, context: float, critic: bool = False) -> float:
    """Forward FLOPs of one token attending to `context` earlier tokens on average: 2 per
    multiply-add of the matmul weights, plus QK^T and AV (2 * context * heads * (qk + v) dims per
    layer). For a causal sequence of length s the average context is s / 2."""
    attn = 2 * context * a.heads * (a.qk_head_dim + (a.v_head_dim if a.mla else a.head_dim)) * a.num_layers
    return 2 * matmul_params_per_token(a, critic) + attn


def train_flops_per_token(a: Arch, seq_len: int, recompute: str = "none", critic: bool = False) -> float:
    """Model FLOPs of forward + backward (backward = 2 x forward) on sequences of seq_len tokens.
    Full recompute runs the forward twice (hardware FLOPs; MFU conventionally excludes it, so pass
    recompute="none" for MFU)."""
    fwd = forward_flops_per_token(a, seq_len / 2, critic)
    return fwd * (4 if recompute == "full" else 3)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def lcm(*xs: int) -> int:
    return math.lcm(*xs)
