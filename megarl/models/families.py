"""Model families: what megarl reads from a Hugging Face `config.json`.

A `ModelSpec` is the layout-independent description of a decoder-only model: sizes, attention
variant, MoE routing, and the HF weight names of its family. Everything megarl builds (the Megatron
model, weight converters, the critic) starts from it. Adding a family means adding one
`_spec_<family>` function and, if its weight names differ, a `HFNames` entry.

DeepSeek-V3 (MLA attention, shared experts, sigmoid routing with expert bias) fits this shape:
`attention="mla"` and `moe_shared_experts` are reserved for it and refused until its converter lands.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


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
    attention: str = "gqa"
    hf_names: HFNames = field(default_factory=HFNames)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rows of the Megatron embedding/output layer: a multiple of tp (and of 128*tp
        for real vocabularies, for GEMM efficiency). Padding rows are zero and masked out of every
        log-prob, entropy and KL (`true_vocab_size`)."""
        multiple = tp * (128 if self.vocab_size >= 4096 else 1)
        return -(-self.vocab_size // multiple) * multiple


def _rope(cfg: dict) -> tuple[float, float | None]:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        source = params if params.get("rope_type") == "llama3" else scaling
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, value in expected.items():
            if float(source.get(key, value)) != value:
                raise UnsupportedModelError(f"llama3 rope scaling with {key}={source[key]} is not supported (only {value})")
        return float(theta), float(source.get("factor", 8.0))
    raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported yet; supported: default, llama3")


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


FAMILIES = {
    "llama": _spec_llama,
    "qwen2": _spec_qwen2,
    "qwen3": _spec_qwen3,
    "mixtral": _spec_mixtral,
    "qwen3_moe": _spec_qwen3_moe,
}


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


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Read `<model_dir>/config.json` into a ModelSpec, with errors that name the directory."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UnsupportedModelError(f"{model_dir} is not a Hugging Face model directory: {path} does not exist")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UnsupportedModelError(f"{path} is not valid JSON: {err}") from None
    return spec_from_hf_config(cfg)


def check_layout(spec: ModelSpec, tp: int, pp: int, ep: int = 1, etp: int | None = None, uneven_stages: bool = False) -> None:
    """Refuse a parallel layout the model cannot be split into, showing the arithmetic. With
    `uneven_stages` the stage split is ParallelDims.stage_layer_counts' to check."""
    if spec.num_heads % tp:
        raise ValueError(f"{spec.num_heads} attention heads are not divisible by tp={tp}")
    if spec.num_kv_heads % tp:
        raise ValueError(
            f"{spec.num_kv_heads} key/value heads are not divisible by tp={tp}; "
            f"use a tp that divides {spec.num_kv_heads}"
        )
    if spec.ffn_hidden_size % tp:
        raise ValueError(f"ffn hidden size {spec.ffn_hidden_size} is not divisible by tp={tp}")
    if not uneven_stages and spec.num_layers % pp:
        raise ValueError(f"{spec.num_layers} layers are not divisible by pp={pp}")
    if spec.is_moe:
        if spec.num_experts % ep:
            raise ValueError(f"{spec.num_experts} experts are not divisible by ep={ep}")
        etp = tp if etp is None else etp
        if spec.moe_ffn_hidden_size % etp:
            raise ValueError(f"expert ffn hidden size {spec.moe_ffn_hidden_size} is not divisible by etp={etp}")
    elif ep != 1:
        raise ValueError(f"ep={ep} needs a mixture-of-experts model; {spec.family} is dense")
