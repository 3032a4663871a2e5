"""Megatron-Core models built from Hugging Face model directories."""
from __future__ import annotations

from pathlib import Path


def load_model(model_dir: str | Path, dims, dtype: str = "float32", critic: bool = False, recompute: str = "none"):
    """Build this rank's chunk of the model for `dims` and fill it from the HF checkpoint.

    Returns (model, spec). `critic=True` swaps the LM head for a scalar value head. With virtual
    pipeline stages a rank holds several chunks: use `load_model_chunks`.
    """
    if dims.vpp:
        raise ValueError(f"parallel.vpp={dims.vpp}: this rank holds {dims.vpp} model chunks; use load_model_chunks")
    chunks, spec = load_model_chunks(model_dir, dims, dtype, critic, recompute)
    return chunks[0], spec


def load_model_chunks(model_dir: str | Path, dims, dtype: str = "float32", critic: bool = False, recompute: str = "none"):
    """This rank's model chunks (one per virtual pipeline stage, in schedule order; one without
    interleaving), filled from the HF checkpoint. Returns (chunks, spec)."""
    from megarl.models.builder import build_gpt_model, build_transformer_config, parse_dtype
    from megarl.models.families import load_spec
    from megarl.models.weights import load_hf_weights

    spec = load_spec(model_dir)
    config = build_transformer_config(spec, dims, parse_dtype(dtype), recompute)
    stages = range(dims.vpp) if dims.vpp else [None]
    chunks = [build_gpt_model(spec, dims, config=config, dtype=parse_dtype(dtype), vp_stage=v, value_head=critic, recompute=recompute)
              for v in stages]
    if critic:
        from megarl.models.critic import attach_value_head

        for chunk in chunks:
            attach_value_head(chunk, spec, model_dir)
    load_hf_weights(chunks, spec, dims, model_dir)
    return chunks, spec
