"""ModelSpec + ParallelDims -> Megatron-Core GPTModel (one pipeline stage's chunk of it).

Local (pure PyTorch) layer specs with megarl's SDPA core attention on CPU and wherever TE is absent; Transformer-Engine specs on GPU when TE is installed.
Weight conversion (`megarl.models.convert`) understands both naming schemes.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from megarl.layout import ModelShape, check_model
from megarl.models.families import ModelSpec
from megarl.models.moe_routing import RouterOptions, router_config, use_hf_group_limited_topk
from megarl.models.sequence_parallel import SequenceParallelNorm, local_norms, mla_sequence_sharded_kv
from megarl.distributed.parallel import ParallelDims
from megarl.platform import cpu_compat, current_platform

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def have_transformer_engine() -> bool:
    """Whether Transformer-Engine's PyTorch layers load. `import transformer_engine` alone succeeds
    even when its torch extension is missing or built for another torch (an engine's torch pin
    replaced the image's): the layers then fail at first use, so probe `transformer_engine.pytorch`."""
    try:
        # deferred: optional (transformer_engine)
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or OSError/RuntimeError from a broken extension
        return False
    return True


def uses_transformer_engine() -> bool:
    """Whether the model is built from TE's layers: on a GPU where Transformer-Engine loads."""
    return not current_platform().is_cpu and have_transformer_engine()


def rope_fusion(spec: ModelSpec, use_te: bool) -> bool:
    """Megatron's apply_rope_fusion: TE's fused RoPE wherever TE's layers run. Without it packed
    (thd) micro-batches take Megatron's baseline thd RoPE, a `.tolist()` and a per-sequence
    split/cat for q and k in every layer. Not for MLA (Megatron: experimental, training-only,
    YaRN RoPE only)."""
    return use_te and spec.mla is None


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def build_transformer_config(spec: ModelSpec, dims: ParallelDims, dtype: torch.dtype = torch.float32, recompute: str = "none",
                             routing: RouterOptions | None = None):
    """The TransformerConfig that makes Megatron compute what `transformers` computes for `spec`."""
    from megatron.core.transformer import TransformerConfig  # deferred: megatron (seconds to import) loads only when this runs

    check_model(ModelShape.of_spec(spec), dims.layout)  # heads, widths, stages, experts: megarl.layout's rules
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
            **_deepseek_moe(spec),
        )
    config_class, attention = TransformerConfig, {}
    if spec.mla is not None:
        # deferred: megatron (seconds to import) loads only when this runs
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_class, attention = MLATransformerConfig, _mla_config(spec)
    config = config_class(
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
        # Sequence parallelism (parallel.sequence_parallel, off at tp 1): megarl.models.sequence_parallel
        sequence_parallel=dims.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Fused kernels are CUDA-only and change numerics slightly; parity runs need none. RoPE's is
        # the exception: on GPU the unfused thd path costs host syncs in every layer.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=rope_fusion(spec, uses_transformer_engine()),
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
        **attention,
    )
    cpu_compat.require_finalize_model_grads(config)  # seam 8 (harmless on GPU as well)
    return config


def _deepseek_moe(spec: ModelSpec) -> dict:
    """Sigmoid routing with group-limited top-k, a frozen score-correction bias, shared experts and
    dense first layers (DeepSeek-V3, GLM-4.5); nothing for softmax-routed families."""
    if spec.moe_score_function != "sigmoid":
        return {}
    if spec.moe_num_groups:
        use_hf_group_limited_topk()  # transformers' group scores (top-2 sum), not Megatron's top-(k / groups)
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_num_groups=spec.moe_num_groups,
        moe_router_group_topk=spec.moe_group_topk,
        moe_router_topk_scaling_factor=spec.moe_routed_scaling_factor,
        # The correction bias only picks experts. Megatron adapts it to the load after every step
        # (aux-loss-free balancing); a rate of 0 keeps the checkpoint's bias: RL must not move the
        # routing that the rollout engine, which reads the same bias, uses.
        moe_router_enable_expert_bias=spec.moe_expert_bias,
        moe_router_bias_update_rate=0.0,
        moe_shared_expert_intermediate_size=spec.moe_shared_ffn_hidden_size,
        moe_layer_freq=spec.moe_layer_pattern,
    )


def _mla_config(spec: ModelSpec) -> dict:
    """MLATransformerConfig's fields: latent sizes, and rope (plain or YaRN) on the rope dims only."""
    mla, yarn = spec.mla, spec.yarn
    fields = dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        rotary_base=spec.rope_theta,
        rope_type="rope" if yarn is None else "yarn",
        # without YaRN: factor 1 makes MLA's softmax mscale 1, as in transformers
        rotary_scaling_factor=1.0 if yarn is None else yarn.factor,
    )
    if yarn is not None:
        fields.update(original_max_position_embeddings=yarn.original_max_position_embeddings,
                      beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow,
                      mscale=yarn.mscale, mscale_all_dim=yarn.mscale_all_dim)
    return fields


def layer_spec(spec: ModelSpec, use_te: bool | None = None):
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megarl.models.attention import SDPACoreAttention  # deferred: megatron (megarl.models.attention imports it)

    if use_te is None:
        use_te = uses_transformer_engine()
    mla = spec.mla is not None
    # MLA's q/kv latent norms exist only with qk_layernorm=True in Megatron's specs.
    qk_layernorm = spec.qk_norm or mla
    if use_te:
        te = get_gpt_layer_with_transformer_engine_spec(num_experts=spec.num_experts, qk_layernorm=qk_layernorm,
                                                        multi_latent_attention=mla)
        return _mla_te_down_projections(te) if mla else te
    if mla:
        cpu_compat.mla_without_transformer_engine()  # seam 10
    local = get_gpt_layer_local_spec(num_experts=spec.num_experts, qk_layernorm=qk_layernorm, normalization="RMSNorm",
                                     multi_latent_attention=mla)
    # Megatron's local attention materialises the scores and refuses packed (thd) micro-batches,
    # and rejects MLA's different k/v head sizes; ours runs scaled_dot_product_attention, per
    # length group when packed.
    local.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    # Megatron's local norm refuses sequence parallelism; ours tags its weights for the TP sum.
    return local_norms(local)


def _mla_te_down_projections(te_spec):
    """The TE spec keeps MLA's q/kv down projections whole on every TP rank (TELinear, duplicated);
    the local spec splits their rows over TP and gathers the output. Use TE's column-parallel
    linear (a choice MLASelfAttention accepts) so both specs hold the same shards and one weight
    mapping serves both."""
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

    attention = te_spec.submodules.self_attention.submodules
    attention.linear_q_down_proj = TEColumnParallelLinear
    attention.linear_kv_down_proj = TEColumnParallelLinear
    return te_spec


def decoder_spec(spec: ModelSpec, config, vp_stage: int | None = None, use_te: bool | None = None):
    """What GPTModel builds its decoder from: the block spec of this pipeline stage's layers (dense
    first layers, then MoE layers, or all alike) and its final norm. Without Transformer-Engine the
    final norm is megarl's `SequenceParallelNorm`: the one TransformerBlock gives a bare layer spec,
    Megatron's WrappedTorchNorm, refuses sequence parallelism."""
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if use_te is None:
        use_te = uses_transformer_engine()
    final_norm = LayerNormImpl if use_te else SequenceParallelNorm
    moe_layer = layer_spec(spec, use_te)
    dense_layer = layer_spec(dataclasses.replace(spec, num_experts=None), use_te) if spec.moe_first_dense_layers else moe_layer
    pattern = spec.moe_layer_pattern if spec.moe_first_dense_layers else None
    # The slicing of Megatron's get_gpt_decoder_block_spec (which cannot take our core attention).
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        from megatron.core.transformer.enums import LayerType  # deferred: megatron (seconds to import) loads only when this runs

        ids = layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage)
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        ids = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    return TransformerBlockSubmodules(layer_specs=[moe_layer if pattern is None or pattern[i] else dense_layer for i in ids],
                                      layer_norm=final_norm)


def build_gpt_model(spec: ModelSpec, dims: ParallelDims, config=None, dtype: torch.dtype = torch.float32, vp_stage: int | None = None, value_head: bool = False, recompute: str = "none",
                    routing: RouterOptions | None = None, meta: bool = False):
    """This rank's pipeline-stage chunk of the model, on the platform's device, weights uninitialised.

    value_head=True builds a critic backbone: the output layer is never tied to the embedding,
    because `megarl.models.critic` replaces it by a scalar head. meta=True builds it on the meta
    device (shapes, no storage: the dry run, megarl.tools.dryrun).
    """
    from megatron.core.models.gpt import GPTModel  # deferred: megatron (seconds to import) loads only when this runs

    config = config or build_transformer_config(spec, dims, dtype, recompute, routing)
    # With virtual stages the embedding lives in the first chunk of the first stage, the head in
    # the last chunk of the last stage.
    first_chunk = vp_stage is None or vp_stage == 0
    last_chunk = vp_stage is None or vp_stage == dims.chunks_per_stage - 1
    with _mla_latent_norms_at_build(config), (torch.device("meta") if meta else contextlib.nullcontext()):
        model = _gpt_model(GPTModel, spec, dims, config, vp_stage, value_head, first_chunk, last_chunk)
    mla_sequence_sharded_kv(model, config)  # the RoPE key's gradient summed over TP under SP
    return model if meta else model.to(current_platform().device)


@contextlib.contextmanager
def _mla_latent_norms_at_build(config):
    """MLA's q/kv latent norms need `qk_layernorm=True` while the layers are built (Megatron-Core
    0.19 refuses norm modules in the spec otherwise; 0.16 ignores the flag), and False afterwards:
    finalize_model_grads sums the grads of parameters named `q_layernorm` over TP when it is set,
    which is right for per-head q/k norms but doubles MLA's, whose grads are already complete on
    every TP rank (each rank normalises the whole gathered latent, and the column-parallel up
    projection all-reduces its input gradient). Under sequence parallelism the latents are scattered
    back to s/tp tokens before the norms, whose grads are then partial: `SequenceParallelNorm`'s
    `sequence_parallel` tag sums them, once (the two rules share one `or` in finalize_model_grads)."""
    if not getattr(config, "multi_latent_attention", False):
        yield
        return
    config.qk_layernorm = True
    try:
        yield
    finally:
        config.qk_layernorm = False


def _gpt_model(GPTModel, spec, dims, config, vp_stage, value_head, first_chunk, last_chunk):
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage

    pp_group = dims.pp_group
    return GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec(spec, config, vp_stage),
        vocab_size=spec.padded_vocab_size(dims.tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=is_pp_first_stage(pp_group) and first_chunk,
        post_process=is_pp_last_stage(pp_group) and last_chunk,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_embeddings and not value_head,
        position_embedding_type="rope",  # MLA layers apply their own (and GPTModel then builds none)
        rotary_percent=spec.rotary_percent,
        rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
        rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=spec.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
    )
