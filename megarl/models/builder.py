"""ModelSpec + ParallelDims -> Megatron-Core GPTModel (one pipeline stage's chunk of it).

Local (pure PyTorch) layer specs with megarl's SDPA core attention on CPU and wherever TE is absent; Transformer-Engine specs on GPU when TE is installed.
Weight conversion (`megarl.models.convert`) understands both naming schemes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megarl.models.families import ModelSpec, check_layout
from megarl.models.moe_routing import RouterOptions, router_config
from megarl.parallel import ParallelDims
from megarl.platform import current_platform

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def have_transformer_engine() -> bool:
    """Whether Transformer-Engine's PyTorch layers load. `import transformer_engine` alone succeeds
    even when its torch extension is missing or built for another torch (an engine's torch pin
    replaced the image's): the layers then fail at first use, so probe `transformer_engine.pytorch`."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or OSError/RuntimeError from a broken extension
        return False
    return True


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def build_transformer_config(spec: ModelSpec, dims: ParallelDims, dtype: torch.dtype = torch.float32, recompute: str = "none",
                             routing: RouterOptions | None = None):
    """The TransformerConfig that makes Megatron compute what `transformers` computes for `spec`."""
    from megatron.core.transformer import TransformerConfig

    from megarl.platform import cpu_compat

    uneven = dims.first_stage_layers is not None or dims.last_stage_layers is not None
    check_layout(spec, dims.tp, dims.pp, dims.ep, dims.etp, uneven_stages=uneven)
    dims.stage_layer_counts(spec.num_layers)  # uneven end stages and vpp chunks must split the layers
    platform = current_platform()
    moe = {}
    if spec.is_moe:
        dispatcher = "alltoall" if dims.ep > 1 else "allgather"
        if platform.is_cpu:
            dispatcher = cpu_compat.cpu_moe_token_dispatcher(dispatcher)  # seam 7
        moe = dict(
            num_moe_experts=spec.num_experts,
            moe_router_topk=spec.moe_topk,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            # HF: softmax over all experts, top-k, optionally renormalise. Megatron's default (top-k of
            # the logits, then softmax over those k) equals the renormalised form; pre_softmax is the other.
            moe_router_pre_softmax=not spec.moe_renormalize_topk,
            moe_token_dispatcher_type=dispatcher,
            moe_grouped_gemm=False,
            # fp32 router logits always; no load-balancing loss unless asked (megarl.models.moe_routing)
            **router_config(routing),
        )
    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp,
        num_layers_in_first_pipeline_stage=dims.first_stage_layers,
        num_layers_in_last_pipeline_stage=dims.last_stage_layers,
        # Interleaved with pp=2, a stage's previous and next stage are the same rank: batched p2p
        # then pairs its send of gradients with the peer's receive of activations (same shapes,
        # silently swapped: wrong gradients, found by tests/layouts). The unbatched path orders
        # the sends and receives by even / odd rank.
        batch_p2p_comm=not (dims.vpp and dims.pp == 2),
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.expert_tp,
        sequence_parallel=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Fused kernels are CUDA-only and change numerics slightly; parity runs need none.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        # Weights come from the checkpoint, but Megatron's initialisers are also what tag TP-split
        # parameters (`tensor_model_parallel`, `partition_dim`); without the tags the optimizer
        # counts split weights as TP duplicates and the gradient norm comes out wrong.
        perform_initialization=True,
        use_cpu_initialization=platform.is_cpu,
        # Every micro-batch of one schedule call is padded to one length (see engine), so pipeline
        # p2p shapes are fixed; the allgather MoE dispatcher (used on CPU) also requires this.
        variable_seq_lengths=False,
        # "selective" recomputes core attention only; "full" recomputes every layer's forward.
        recompute_granularity=None if recompute == "none" else recompute,
        recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None,
        **moe,
    )
    cpu_compat.require_finalize_model_grads(config)  # seam 8 (harmless on GPU as well)
    return config


def layer_spec(spec: ModelSpec, use_te: bool | None = None):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megarl.models.attention import SDPACoreAttention

    if use_te is None:
        use_te = not current_platform().is_cpu and have_transformer_engine()
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(num_experts=spec.num_experts, qk_layernorm=spec.qk_norm)
    local = get_gpt_layer_local_spec(num_experts=spec.num_experts, qk_layernorm=spec.qk_norm, normalization="RMSNorm")
    # Megatron's local attention materialises the scores and refuses packed (thd) micro-batches;
    # ours runs scaled_dot_product_attention, per length group when packed.
    local.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return local


def build_gpt_model(spec: ModelSpec, dims: ParallelDims, config=None, dtype: torch.dtype = torch.float32, vp_stage: int | None = None, value_head: bool = False, recompute: str = "none",
                    routing: RouterOptions | None = None):
    """This rank's pipeline-stage chunk of the model, on the platform's device, weights uninitialised.

    value_head=True builds a critic backbone: the output layer is never tied to the embedding,
    because `megarl.models.critic` replaces it by a scalar head.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage

    config = config or build_transformer_config(spec, dims, dtype, recompute, routing)
    pp_group = dims.pp_group
    # With virtual stages the embedding lives in the first chunk of the first stage, the head in
    # the last chunk of the last stage.
    first_chunk = vp_stage is None or vp_stage == 0
    last_chunk = vp_stage is None or vp_stage == dims.chunks_per_stage - 1
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(spec),
        vocab_size=spec.padded_vocab_size(dims.tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=is_pp_first_stage(pp_group) and first_chunk,
        post_process=is_pp_last_stage(pp_group) and last_chunk,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_embeddings and not value_head,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
        rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=spec.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
    )
    return model.to(current_platform().device)
