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
- **MLA's kv down projection.** Megatron-Core's MLA (0.16 and 0.19 alike) takes one of two paths
  by the width of that projection's output. Column-parallel (megarl's local and TE specs: the
  weight shards over TP) gives [s, out/tp]: MLA gathers it over TP and scatters the latent back to
  s/tp tokens, but hands every rank the whole sequence's shared RoPE key `k_pos_emb`, of which each
  rank's heads use their share, and nothing sums that gradient over TP (its weight rows got 0.3-1x
  the true update). Full-width on s/tp tokens (a duplicated linear) takes the other path, whose
  sequence gather of `k_pos_emb` reduce-scatters, i.e. sums, its gradient. `mla_sequence_sharded_kv`
  hooks the projection so that it gives that layout (gather over TP, scatter over the sequence)
  while its weight stays sharded.
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
    # deferred: megatron (seconds to import) loads only when this runs
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


def _kv_full_width_on_own_tokens(module, args, output):
    """Forward hook of MLA's column-parallel kv down projection under sequence parallelism: its
    [s, b, out/tp] output as [s/tp, b, out]. Backward: the sequence scatter all-gathers the (complete,
    TP-summed) gradient of this rank's tokens, the TP gather keeps this rank's columns."""
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.tensor_parallel.mappings import (
        gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    out, bias = output
    if out.size(-1) != module.kv_down_local_width:
        # a hook that ran before this one changed the layout (LoRA's adds on the column output: it
        # registers with prepend=True)
        raise RuntimeError(f"MLA kv down projection: output width {out.size(-1)}, expected the column shard's {module.kv_down_local_width}")
    out = gather_from_tensor_model_parallel_region(out, group=module.tp_group)
    return scatter_to_sequence_parallel_region(out, group=module.tp_group), bias


def mla_sequence_sharded_kv(model, config) -> int:
    """Under sequence parallelism at tp > 1, hook every MLA layer's kv down projection of `model` so
    that Megatron sums the RoPE key's gradient over TP (see the module docstring). A no-op
    otherwise. Hooks added after this one (LoRA's) see the relayouted output unless prepended.
    Returns how many projections were hooked."""
    if not (getattr(config, "multi_latent_attention", False) and config.sequence_parallel
            and config.tensor_model_parallel_size > 1):
        return 0
    count = 0
    for name, module in model.named_modules():
        if not name.endswith("self_attention.linear_kv_down_proj"):
            continue
        local = module.weight.shape[0]  # rows of this rank: the output width of a column shard
        if local == config.kv_lora_rank + config.qk_pos_emb_head_dim:
            continue  # a duplicated (whole) linear takes Megatron's summing path already
        module.kv_down_local_width = local
        module.register_forward_hook(_kv_full_width_on_own_tokens)
        count += 1
    return count
