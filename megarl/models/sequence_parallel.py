"""Sequence parallelism (`parallel.sequence_parallel`) where Megatron-Core leaves a gap.

Under sequence parallelism the activations between the tensor-parallel regions are split along the
sequence over the tp group: each TP rank holds s/tp tokens for the norms, dropout, residuals and the
MoE router, and the column-parallel linears all-gather them (the row-parallel ones reduce-scatter).
Megatron-Core does the embedding's scatter (`LanguageModelEmbedding`'s reduce-scatter), the linears
and the LM head's gather itself. What it leaves to megarl:

- **Norms.** A norm on s/tp tokens gets only its tokens' share of its weight gradient, so the
  weights must be tagged `sequence_parallel` for `finalize_model_grads` to sum their gradients over
  TP (FusedLayerNorm and TENorm tag them). The local spec's `WrappedTorchNorm`, which megarl gets
  wherever Transformer-Engine is absent (and always for RMSNorm without TE), refuses sequence
  parallelism outright (Megatron-LM#1448; 0.16.1 and 0.19.2). `SequenceParallelNorm` builds the same
  torch module and tags it; `local_norms` puts it into a local layer spec. MLA's latent norms are
  covered too: under sequence parallelism Megatron scatters the gathered latents back to s/tp
  tokens, so their gradients are partial per TP rank and summed by the same tag.
- **Sequence lengths.** Every micro-batch's length must divide by tp (`sequence_multiple`).
- **The critic's value head** (`megarl.models.critic`) and **routing replay**
  (`megarl.models.moe_routing.sequence_parallel_shard`) see the s/tp shard; each handles it where it lives.
"""
from __future__ import annotations

import torch


class SequenceParallelNorm:
    """A stand-in for Megatron's `WrappedTorchNorm` (the local spec's norm) that allows sequence
    parallelism: `torch.nn.RMSNorm` / `LayerNorm` as `config.normalization` says, its parameters
    tagged `sequence_parallel = config.sequence_parallel`. Without sequence parallelism it builds
    exactly the module WrappedTorchNorm builds (same class, shapes, eps and initial values)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str | None = None):
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("zero-centred gamma and memory-efficient layer norm need Transformer-Engine's or apex's norm")
        kinds = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in kinds:
            raise ValueError(f"normalization {config.normalization!r}: only {', '.join(kinds)} have a local norm")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            # finalize_model_grads sums the grads of tagged parameters over TP when the config says
            # sequence_parallel (each TP rank normalised only its s/tp tokens).
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def local_norms(layer_spec):
    """The local layer spec `layer_spec` with every `WrappedTorchNorm` replaced by
    `SequenceParallelNorm` (input and pre-MLP norms; attention's q/k norms or MLA's latent norms).
    Modifies and returns the spec."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    layer = layer_spec.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(layer, name, None) is WrappedTorchNorm:
            setattr(layer, name, SequenceParallelNorm)
    attention = layer.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):
        if getattr(attention, name, None) is WrappedTorchNorm:
            setattr(attention, name, SequenceParallelNorm)
    return layer_spec


def sequence_multiple(dims) -> int:
    """What every micro-batch's sequence length must be a multiple of: tp under sequence
    parallelism (the s/tp split), else 1."""
    return dims.tp if getattr(dims, "sequence_parallel", False) else 1
