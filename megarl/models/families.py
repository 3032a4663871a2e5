"""Model families: what megarl reads from a Hugging Face `config.json`.

A `ModelSpec` is the layout-independent description of a decoder-only model: sizes, attention
variant, MoE routing, and the HF weight names of its family. Everything megarl builds (the Megatron
model, weight converters, the critic) starts from it. Adding a family means adding one
`_spec_<family>` function and, if its weight names differ, a `HFNames` entry.

DeepSeek-V3 / Kimi-K2 (`deepseek_v3`: multi-latent attention, YaRN rope, dense first layers, shared
experts, sigmoid routing with group-limited top-k and a frozen score-correction bias) and GLM-4.5
(`glm4_moe`: partial rotary, optional q/k norm, the same MoE block) are described by the MLA / YaRN /
routing fields below. What Megatron-Core computes differently from transformers is refused here, with
the reason, rather than loaded and computed differently (see `_moe_routing`, `_yarn`).
Multi-token-prediction layers (`num_nextn_predict_layers`) are not part of the causal LM: they are
skipped on load and absent from export (`mtp_layers` records how many the checkpoint has).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from megarl.layout.model import padded_vocab


# The one list of model families, in the three groups the rest of megarl and its tests enumerate:
# make_tiny_model (and model.make_tiny.arch), the config's checks of tiny MoE models, the tests'
# tiny-model fixtures (tests/conftest.py) and docs/models.md's table (tests/foundation checks it).
# `FAMILIES` below maps each name to its config.json reader.
DENSE_FAMILIES = ("llama", "qwen2", "qwen3")
MOE_FAMILIES = ("mixtral", "qwen3_moe")  # softmax top-k routing, GQA
# the 355B-671B class: sigmoid group-limited routing, shared experts, dense first layers, MTP layers
# (deepseek_v3: multi-latent attention and YaRN; glm4_moe: partial rotary)
LARGE_MOE_FAMILIES = ("deepseek_v3", "glm4_moe")
FAMILY_NAMES = DENSE_FAMILIES + MOE_FAMILIES + LARGE_MOE_FAMILIES


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class HFNames:
    """HF checkpoint names that differ between families (per layer, after `model.layers.{i}.`)."""

    moe_block: str = "mlp"  # "block_sparse_moe" for Mixtral
    router: str = "gate"
    expert_gate: str = "gate_proj"
    expert_up: str = "up_proj"
    expert_down: str = "down_proj"


@dataclass(frozen=True)
class YarnRope:
    """YaRN rope scaling in Megatron-Core's terms (`MLATransformerConfig`), chosen so that the inverse
    frequencies, the cos/sin "attention factor" and the softmax scale equal transformers' (see `_yarn`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


@dataclass(frozen=True)
class MLA:
    """Multi-latent attention sizes (DeepSeek-V2/V3); q_lora_rank None = a plain q projection."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelSpec:
    family: str
    architecture: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling_factor: float | None = None  # Llama-3.1 style "llama3" scaling
    num_experts: int | None = None
    moe_topk: int = 0
    moe_ffn_hidden_size: int | None = None
    moe_renormalize_topk: bool = True  # softmax over the top-k only (Mixtral, Qwen3-MoE norm_topk_prob)
    moe_score_function: str = "softmax"  # "sigmoid": DeepSeek-V3 / GLM-4.5
    moe_num_groups: int | None = None  # group-limited top-k (n_group / topk_group); None = plain top-k
    moe_group_topk: int | None = None
    moe_routed_scaling_factor: float | None = None
    moe_expert_bias: bool = False  # e_score_correction_bias: frozen, loaded and exported unchanged
    moe_shared_ffn_hidden_size: int | None = None  # n_shared_experts * moe_intermediate_size
    moe_first_dense_layers: int = 0  # first_k_dense_replace: these layers have a dense MLP
    attention: str = "gqa"  # or "mla" (then `mla` is set)
    mla: MLA | None = None
    rotary_percent: float = 1.0  # partial_rotary_factor: rope on the first head_dim * this dims
    yarn: YarnRope | None = None
    mtp_layers: int = 0  # multi-token-prediction layers in the checkpoint (skipped)
    hf_names: HFNames = field(default_factory=HFNames)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def moe_layer_pattern(self) -> list[int]:
        """Megatron's `moe_layer_freq` list: 0 = dense MLP layer, 1 = MoE layer."""
        return [0] * self.moe_first_dense_layers + [1] * (self.num_layers - self.moe_first_dense_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.moe_first_dense_layers

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rows of the Megatron embedding/output layer: a multiple of tp (and of 128*tp
        for real vocabularies, for GEMM efficiency). Padding rows are zero and masked out of every
        log-prob, entropy and KL (`true_vocab_size`)."""
        return padded_vocab(self.vocab_size, tp)


def _rope_parameters(cfg: dict) -> tuple[float, str, dict]:
    """(rope_theta, rope_type, the dict holding the scaling keys): transformers 5 writes
    `rope_parameters`, older config.json files `rope_theta` plus `rope_scaling`."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    source = params if params.get("rope_type") not in (None, "default") else scaling
    return float(theta), rope_type, source


def _rope(cfg: dict) -> tuple[float, float | None]:
    theta, rope_type, source = _rope_parameters(cfg)
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, value in expected.items():
            if float(source.get(key, value)) != value:
                raise UnsupportedModelError(f"llama3 rope scaling with {key}={source[key]} is not supported (only {value})")
        return theta, float(source.get("factor", 8.0))
    raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported yet; supported: default, llama3")


def _yarn_mscale(factor: float, mscale: float) -> float:
    """transformers' and Megatron-Core's `get_mscale` (the same formula in both)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(source: dict, family: str) -> YarnRope:
    """transformers' YaRN (`_compute_yarn_parameters`, DeepSeek's `yarn_apply_mscale`) in Megatron's terms.

    transformers scales cos/sin by `attention_factor` (given, or mscale(f, mscale) / mscale(f,
    mscale_all_dim) when both are set, else mscale(f, 1)) and the softmax by mscale(f, mscale_all_dim)^2
    (when mscale_all_dim is set). Megatron's MLA always scales cos/sin by mscale(f, mscale) /
    mscale(f, mscale_all_dim) and the softmax by mscale(f, mscale_all_dim)^2, so mscale_all_dim carries
    over and `mscale` is chosen to give transformers' attention factor (the same number wherever
    transformers' own formula applies; solved for, to float64 rounding, where it does not).
    """
    if source.get("factor") is None or source.get("original_max_position_embeddings") is None:
        raise UnsupportedModelError(f"{family}: yarn rope scaling needs 'factor' and 'original_max_position_embeddings'")
    if source.get("truncate", True) is False:
        raise UnsupportedModelError(f"{family}: yarn with truncate=false is not supported (Megatron-Core always truncates)")
    factor = float(source["factor"])
    mscale, all_dim = source.get("mscale"), float(source.get("mscale_all_dim") or 0.0)
    attention_factor = source.get("attention_factor")
    if attention_factor is None and mscale and all_dim:
        megatron_mscale = float(mscale)
    elif attention_factor is None and not all_dim:
        megatron_mscale = 1.0  # mscale(f, 1) / mscale(f, 0) = mscale(f, 1)
    else:
        wanted = float(attention_factor) if attention_factor is not None else _yarn_mscale(factor, 1.0)
        if factor <= 1:
            if wanted != 1.0:
                raise UnsupportedModelError(f"{family}: yarn attention_factor={wanted} with factor<=1 is not supported")
            megatron_mscale = 1.0
        else:
            megatron_mscale = (wanted * _yarn_mscale(factor, all_dim) - 1.0) / (0.1 * math.log(factor))
    return YarnRope(factor=factor, original_max_position_embeddings=int(source["original_max_position_embeddings"]),
                    beta_fast=float(source.get("beta_fast") or 32), beta_slow=float(source.get("beta_slow") or 1),
                    mscale=megatron_mscale, mscale_all_dim=all_dim)


def _dense_common(cfg: dict, family: str) -> dict:
    heads = cfg["num_attention_heads"]
    theta, factor = _rope(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{family}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    # transformers applies a sliding window when Qwen's use_sliding_window is set or Mixtral's
    # sliding_window is not null; Megatron's local attention has none, so log-probs would differ.
    window = cfg.get("sliding_window") if family == "mixtral" or cfg.get("use_sliding_window") else None
    if window is not None or any(t != "full_attention" for t in cfg.get("layer_types") or ()):
        raise UnsupportedModelError(
            f"{family}: sliding-window attention (sliding_window={window}, layer_types={cfg.get('layer_types')}) "
            f"is not supported yet; if every sequence is shorter than the window, set "
            f'"sliding_window": null and "use_sliding_window": false in config.json'
        )
    return dict(
        family=family,
        architecture=(cfg.get("architectures") or [family])[0],
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling_factor=factor,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _spec_llama(cfg: dict) -> ModelSpec:
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise UnsupportedModelError("llama with attention_bias/mlp_bias is not supported yet")
    return ModelSpec(**_dense_common(cfg, "llama"))


def _spec_qwen2(cfg: dict) -> ModelSpec:
    return ModelSpec(**_dense_common(cfg, "qwen2"), qkv_bias=True)


def _spec_qwen3(cfg: dict) -> ModelSpec:
    return ModelSpec(**_dense_common(cfg, "qwen3"), qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True)


def _spec_mixtral(cfg: dict) -> ModelSpec:
    return ModelSpec(
        **_dense_common(cfg, "mixtral"),
        num_experts=cfg["num_local_experts"],
        moe_topk=cfg["num_experts_per_tok"],
        moe_ffn_hidden_size=cfg["intermediate_size"],
        moe_renormalize_topk=True,
        hf_names=HFNames(moe_block="block_sparse_moe", router="gate", expert_gate="w1", expert_up="w3", expert_down="w2"),
    )


def _spec_qwen3_moe(cfg: dict) -> ModelSpec:
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedModelError("qwen3_moe with dense layers (mlp_only_layers / decoder_sparse_step) is not supported yet")
    return ModelSpec(
        **_dense_common(cfg, "qwen3_moe"),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=True,
        num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
        moe_topk=cfg["num_experts_per_tok"],
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        moe_renormalize_topk=bool(cfg.get("norm_topk_prob", False)),
    )


def _moe_routing(cfg: dict, family: str) -> dict:
    """DeepSeek-V3-style MoE (also GLM-4.5): sigmoid scores, a score-correction bias that only
    chooses experts, group-limited top-k, renormalised and scaled weights, shared experts."""
    experts, topk = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    if topk > 1 and not cfg.get("norm_topk_prob", True):
        raise UnsupportedModelError(f"{family}: norm_topk_prob=false is not supported (Megatron-Core always renormalises "
                                    f"sigmoid top-k weights)")
    groups, group_topk = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    if groups > 1 and group_topk < groups:
        if experts % groups:
            raise UnsupportedModelError(f"{family}: {experts} routed experts do not split into n_group={groups} groups")
        if topk > group_topk * (experts // groups):
            raise UnsupportedModelError(f"{family}: num_experts_per_tok={topk} is more than the {group_topk} chosen groups "
                                        f"(topk_group) x {experts // groups} experts per group hold")
        # Groups are ranked by their two best experts, as transformers does (megarl.models.moe_routing).
    else:
        groups = group_topk = None  # every group is chosen: plain top-k
    dense = min(cfg.get("first_k_dense_replace") or 0, cfg["num_hidden_layers"])
    if dense >= cfg["num_hidden_layers"]:
        raise UnsupportedModelError(f"{family}: first_k_dense_replace={dense} leaves no MoE layer")
    shared = (cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"]
    return dict(
        num_experts=experts,
        moe_topk=topk,
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        moe_renormalize_topk=True,
        moe_score_function="sigmoid",
        moe_num_groups=groups,
        moe_group_topk=group_topk,
        moe_routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        moe_expert_bias=True,
        moe_shared_ffn_hidden_size=shared or None,
        moe_first_dense_layers=dense,
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or cfg.get("num_mtp_layers") or 0),
    )


def _spec_deepseek_v3(cfg: dict) -> ModelSpec:
    family = "deepseek_v3"
    if cfg.get("attention_bias"):
        raise UnsupportedModelError(f"{family}: attention_bias=true is not supported (DeepSeek-V3 and Kimi-K2 have none)")
    if cfg.get("rope_interleave", True) is False:
        raise UnsupportedModelError(f"{family}: rope_interleave=false is not supported (Megatron-Core's MLA reads the "
                                    f"rope dims interleaved, as DeepSeek-V3 checkpoints store them)")
    # transformers builds the q/kv latent norms with eps 1e-6 whatever rms_norm_eps says; Megatron
    # uses one epsilon for every norm.
    if cfg.get("rms_norm_eps", 1e-6) != 1e-6:
        raise UnsupportedModelError(f"{family}: rms_norm_eps={cfg['rms_norm_eps']} is not supported (only 1e-6: "
                                    f"transformers' latent norms always use 1e-6)")
    theta, rope_type, source = _rope_parameters(cfg)
    if rope_type not in ("default", "yarn"):
        raise UnsupportedModelError(f"{family}: rope scaling type {rope_type!r} is not supported; supported: default, yarn")
    plain = dict(cfg, rope_parameters={"rope_theta": theta, "rope_type": "default"}, rope_scaling=None)
    common = _dense_common(plain, family)
    mla = MLA(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
              qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
              v_head_dim=cfg["v_head_dim"])
    # MLA has one key/value per query head: transformers' num_key_value_heads must equal the heads
    # (it repeats keys by heads // num_key_value_heads otherwise, and its forward fails).
    if common["num_kv_heads"] != common["num_heads"]:
        raise UnsupportedModelError(f"{family}: num_key_value_heads={common['num_kv_heads']} must equal "
                                    f"num_attention_heads={common['num_heads']} for multi-latent attention")
    common.update(head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    return ModelSpec(**common, attention="mla", mla=mla,
                     yarn=_yarn(source, family) if rope_type == "yarn" else None, **_moe_routing(cfg, family))


def _spec_glm4_moe(cfg: dict) -> ModelSpec:
    family = "glm4_moe"
    params = cfg.get("rope_parameters") or {}
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    common = _dense_common(cfg, family)
    rotary_dims = int(common["head_dim"] * partial)
    if rotary_dims % 2 or rotary_dims == 0:
        raise UnsupportedModelError(f"{family}: partial_rotary_factor={partial} of head_dim={common['head_dim']} "
                                    f"gives {rotary_dims} rotary dims; an even, non-zero number is needed")
    return ModelSpec(**common, qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=bool(cfg.get("use_qk_norm", False)),
                     rotary_percent=partial, **_moe_routing(cfg, family))


FAMILIES = {
    "llama": _spec_llama,
    "qwen2": _spec_qwen2,
    "qwen3": _spec_qwen3,
    "mixtral": _spec_mixtral,
    "qwen3_moe": _spec_qwen3_moe,
    "deepseek_v3": _spec_deepseek_v3,  # also Kimi-K2 (same architecture)
    "glm4_moe": _spec_glm4_moe,
}
assert tuple(FAMILIES) == FAMILY_NAMES, "FAMILIES and FAMILY_NAMES list the same families, in one order"


def spec_from_hf_config(cfg: dict) -> ModelSpec:
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} (architectures {cfg.get('architectures')}) is not supported; "
            f"supported families: {', '.join(FAMILIES)}"
        )
    try:
        return FAMILIES[model_type](cfg)
    except KeyError as missing:
        raise UnsupportedModelError(f"config.json of a {model_type} model lacks the key {missing}") from None


def read_hf_config(path: str | Path) -> dict:
    """A Hugging Face config.json (the file, or the model directory holding it) as a dict: the one
    reader of config.json, for the model builder and the planner alike. UnsupportedModelError (a
    ValueError) names the path when it is missing or not JSON."""
    p = Path(path)
    if not p.is_file():
        p = p / "config.json"
    if not p.is_file():
        raise UnsupportedModelError(f"{path} is not a Hugging Face model directory: {p} does not exist (pass the model "
                                    f"directory, or its config.json)")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise UnsupportedModelError(f"{p} is not valid JSON: {err}") from None


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Read `<model_dir>/config.json` into a ModelSpec, with errors that name the directory."""
    return spec_from_hf_config(read_hf_config(model_dir))
