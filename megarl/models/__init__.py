"""Megatron-Core models built from Hugging Face model directories."""
from __future__ import annotations

from pathlib import Path

from megarl.models.families import load_spec


def load_model(model_dir: str | Path, dims, dtype: str = "float32", critic: bool = False, recompute: str = "none",
               routing=None):
    """Build this rank's chunk of the model for `dims` and fill it from the HF checkpoint.

    Returns (model, spec). `critic=True` swaps the LM head for a scalar value head. routing: the
    MoE routers' `megarl.models.moe_routing.RouterOptions` (None: the defaults). With virtual
    pipeline stages a rank holds several chunks: use `load_model_chunks`.
    """
    if dims.vpp:
        raise ValueError(f"parallel.vpp={dims.vpp}: this rank holds {dims.vpp} model chunks; use load_model_chunks")
    chunks, spec = load_model_chunks(model_dir, dims, dtype, critic, recompute, routing)
    return chunks[0], spec


def load_model_chunks(model_dir: str | Path, dims, dtype: str = "float32", critic: bool = False, recompute: str = "none",
                      routing=None, meta: bool = False):
    """This rank's model chunks (one per virtual pipeline stage, in schedule order; one without
    interleaving), filled from the HF checkpoint. Returns (chunks, spec). meta=True: on the meta
    device from config.json alone, nothing loaded (the dry run, megarl.tools.dryrun)."""
    # deferred: torch (megarl.models.builder, moe_routing and weights import it); the config check imports
    # megarl.models (the families) without it
    from megarl.models.builder import build_gpt_model, build_transformer_config, parse_dtype
    from megarl.models.moe_routing import check_routing_options, prepare
    from megarl.models.weights import load_hf_weights

    spec = load_spec(model_dir)
    if routing is not None:
        check_routing_options(routing, spec.is_moe, spec.family)
    config = build_transformer_config(spec, dims, parse_dtype(dtype), recompute, routing)
    stages = range(dims.vpp) if dims.vpp else [None]
    chunks = [build_gpt_model(spec, dims, config=config, dtype=parse_dtype(dtype), vp_stage=v, value_head=critic, recompute=recompute,
                              routing=routing, meta=meta)
              for v in stages]
    for chunk in chunks:
        prepare(chunk, routing)
    if critic:
        from megarl.models.critic import attach_value_head  # deferred: torch, as above

        for chunk in chunks:
            attach_value_head(chunk, spec, model_dir)
    if not meta:
        load_hf_weights(chunks, spec, dims, model_dir)
    return chunks, spec
