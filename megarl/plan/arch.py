"""A model's tensors, parameter counts and FLOPs, from its Hugging Face `config.json` alone.

Covers megarl's families (llama, qwen2, qwen3, mixtral, qwen3_moe) and the 355B-671B MoE class
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
import json
import math
from dataclasses import dataclass
from pathlib import Path

SUPPORTED = ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3", "glm4_moe")


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

    def padded_vocab(self, tp: int) -> int:
        """Megatron's embedding rows (megarl.models.families.ModelSpec.padded_vocab_size)."""
        multiple = tp * (128 if self.vocab >= 4096 else 1)
        return -(-self.vocab // multiple) * multiple

    def kv_cache_bytes_per_token(self, rollout_tp: int, dtype_bytes: int = 2) -> int:
        """KV cache one token takes on one rollout GPU: K and V of this GPU's kv heads in every
        layer (heads are replicated when rollout_tp exceeds them); MLA caches one latent
        (kv_lora_rank + rope dims) per layer, replicated on every TP rank (vLLM)."""
        if self.mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        heads_here = max(1, self.kv_heads // rollout_tp)
        return self.num_layers * 2 * heads_here * self.head_dim * dtype_bytes


def load_config(path: str | Path) -> dict:
    """A HF config.json (or a directory holding one) as a dict; ValueError naming the problem."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"{path}: no config.json there; pass a Hugging Face config.json or the model directory holding it")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{p} is not valid JSON: {err}") from None


def arch_from_config(cfg: dict) -> Arch:
    """Read the sizes of a supported family; ValueError naming a missing key or the family."""
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        raise ValueError(f"model_type {mt!r} is not one the planner knows; supported: {', '.join(SUPPORTED)}")
    try:
        heads = cfg["num_attention_heads"]
        common = dict(model_type=mt, hidden=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"], vocab=cfg["vocab_size"],
                      heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
                      head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, ffn=cfg["intermediate_size"],
                      tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))
        if mt == "llama":
            return Arch(**common)
        if mt == "qwen2":
            return Arch(**common, qkv_bias=True)
        if mt == "qwen3":
            return Arch(**common, qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True)
        if mt == "mixtral":
            return Arch(**common, experts=cfg["num_local_experts"], topk=cfg["num_experts_per_tok"], moe_ffn=cfg["intermediate_size"])
        if mt == "qwen3_moe":
            return Arch(**common, qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True,
                        experts=cfg.get("num_experts") or cfg["num_local_experts"], topk=cfg["num_experts_per_tok"],
                        moe_ffn=cfg["moe_intermediate_size"])
        moe = dict(experts=cfg["n_routed_experts"], topk=cfg["num_experts_per_tok"], moe_ffn=cfg["moe_intermediate_size"],
                   shared_experts=cfg.get("n_shared_experts") or 0, first_dense_layers=cfg.get("first_k_dense_replace", 0),
                   router_bias=cfg.get("topk_method", "noaux_tc") == "noaux_tc",
                   mtp_layers=cfg.get("num_nextn_predict_layers", 0) or 0)
        if mt == "glm4_moe":
            return Arch(**common, **moe, qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=bool(cfg.get("use_qk_norm", False)))
        # deepseek_v3
        return Arch(**common, **moe, mla=True, q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                    qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                    v_head_dim=cfg["v_head_dim"])
    except KeyError as missing:
        raise ValueError(f"config.json of a {mt} model lacks the key {missing}") from None


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


def stage_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None, vpp: int | None = 1) -> list[range]:
    """Layers of each pipeline stage: `first`/`last` layers on the end stages (Megatron's
    num_layers_in_first/last_pipeline_stage), the rest split evenly; with `vpp` virtual stages each
    stage's layers must also cut into vpp equal chunks. ValueError shows the arithmetic. The one
    copy of Megatron-Core's rules (TransformerConfig), used by the planner and by ParallelDims."""
    vpp = vpp or 1
    if pp == 1:
        if first not in (None, num_layers) or last not in (None, num_layers):
            raise ValueError("--first-stage-layers/--last-stage-layers need pp > 1")
        return [range(num_layers)]
    f = first if first is not None else None
    lst = last if last is not None else None
    middle_stages = pp - (f is not None) - (lst is not None)
    rest = num_layers - (f or 0) - (lst or 0)
    if rest < 0 or (middle_stages == 0 and rest != 0) or (middle_stages and (rest == 0 or rest % middle_stages)):
        raise ValueError(f"{num_layers} layers do not split over pp={pp}: first stage {f}, last stage {lst}, "
                         f"{rest} layers left for {middle_stages} stages; choose first/last stage layers so that "
                         f"num_layers - first - last is a positive multiple of the other stages")
    if vpp > 1 and middle_stages == 0:
        # Megatron-Core 0.16's get_transformer_layer_offset divides by the middle stages under vpp
        raise ValueError(f"with vpp={vpp}, pp={pp} has no middle stage when both first and last stage layers are set; "
                         f"set only one of them (the other stage takes the rest)")
    per = rest // middle_stages if middle_stages else 0
    sizes = [per] * pp
    if f is not None:
        sizes[0] = f
    if lst is not None:
        sizes[-1] = lst
    bad = [(stage, n) for stage, n in enumerate(sizes) if n % vpp]
    if bad:
        raise ValueError(f"pipeline stage {bad[0][0]} has {bad[0][1]} layers, not divisible by vpp={vpp} (each stage is "
                         f"cut into vpp equal model chunks); stage layers: {sizes}")
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def lcm(*xs: int) -> int:
    return math.lcm(*xs)
