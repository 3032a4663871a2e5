"""Which HF projections LoRA can target in a model (torch-free: the config checks use it before any
model exists; megarl.models.lora builds the adapters)."""
from __future__ import annotations

# Megatron linear (suffix of its module name) -> the HF projections it holds, in output order.
ATTENTION_PROJECTIONS = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    # multi-latent attention
    "self_attention.linear_q_proj": ("q_proj",),
    "self_attention.linear_q_down_proj": ("q_a_proj",),
    "self_attention.linear_q_up_proj": ("q_b_proj",),
    "self_attention.linear_kv_down_proj": ("kv_a_proj_with_mqa",),
    "self_attention.linear_kv_up_proj": ("kv_b_proj",),
}
DENSE_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def known_modules(spec) -> tuple[str, ...]:
    """Every HF projection name LoRA can target in a model of `spec` (the default target set)."""
    names = list(DENSE_MODULES)
    if spec.mla is not None:  # no k/v projections; q_proj only without a q latent
        q = ["q_proj"] if spec.mla.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
        names = q + ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if spec.is_moe:
        n = spec.hf_names
        names += [x for x in (n.expert_gate, n.expert_up, n.expert_down) if x not in names]
    return tuple(names)


def check_targets(target_modules, spec, key: str = "actor.lora") -> None:
    """One-line refusal (ValueError) of target names the model does not have; None = all."""
    if target_modules is None:
        return
    known = known_modules(spec)
    unknown = [t for t in target_modules if t not in known]
    if unknown:
        raise ValueError(f"{key}.target_modules: {', '.join(unknown)} not in this {spec.family} model; "
                         f"choose from {', '.join(known)}")
