"""Megatron-Core models built from Hugging Face model directories."""
from __future__ import annotations

from pathlib import Path


def load_model(model_dir: str | Path, dims, dtype: str = "float32", critic: bool = False, recompute: str = "none",
               routing=None):
    """Build this rank's chunk of the model for `dims` and fill it from the HF checkpoint.

    Returns (model, spec). `critic=True` swaps the LM head for a scalar value head. routing: the
    MoE routers' `megarl.models.moe_routing.RouterOptions` (None: the defaults).
    """
    from megarl.models.builder import build_gpt_model, parse_dtype
    from megarl.models.families import load_spec
    from megarl.models.weights import load_hf_weights

    spec = load_spec(model_dir)
    from megarl.models.moe_routing import check_routing_options, prepare

    if routing is not None:
        check_routing_options(routing, spec.is_moe, spec.family)
    model = build_gpt_model(spec, dims, dtype=parse_dtype(dtype), value_head=critic, recompute=recompute, routing=routing)
    prepare(model, routing)
    if critic:
        from megarl.models.critic import attach_value_head

        attach_value_head(model, spec, model_dir)
    load_hf_weights(model, spec, dims, model_dir)
    return model, spec
