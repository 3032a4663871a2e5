"""What a model allows of a layout: the one copy of the model-versus-layout rules.

`ModelShape` holds the sizes the rules read (from a `ModelSpec`, `megarl.models.families`, or the
planner's `Arch`, both parsed from config.json by `megarl.models.families.spec_from_hf_config`).
`check_model` raises ValueError with one line naming the parallel.* key and the arithmetic:

- Megatron-Core's rules (every consumer: the trainer's config check, the model builder, the
  log-prob tool, the planner): heads and key/value heads over tp, MLA's latent rows over tp,
  dense, expert and shared-expert ffn widths over tp / etp, layers over the (uneven, virtual)
  pipeline stages, experts over ep, ep only for mixture-of-experts models;
- megarl's training rules (`training=True`: the trainer's config check): MoE at tp > 1 needs
  sequence parallelism (`parallel.sequence_parallel`, on by default); virtual stages with tied
  embeddings.
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.layout.parallel import ParallelLayout


@dataclass(frozen=True)
class ModelShape:
    """Layout-relevant sizes of a model. experts = 0 for dense models; mla_kv_rows = kv_lora_rank +
    qk_rope_head_dim (None without multi-latent attention)."""

    name: str
    num_layers: int
    heads: int
    kv_heads: int
    ffn: int  # dense MLP width
    tie_embeddings: bool = False
    experts: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0  # all shared experts together
    mla_kv_rows: int | None = None
    q_lora_rank: int | None = None

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @classmethod
    def of_spec(cls, spec) -> "ModelShape":
        """From a megarl.models.families.ModelSpec."""
        mla = spec.mla
        return cls(name=spec.family, num_layers=spec.num_layers, heads=spec.num_heads, kv_heads=spec.num_kv_heads,
                   ffn=spec.ffn_hidden_size, tie_embeddings=spec.tie_embeddings, experts=spec.num_experts or 0,
                   moe_ffn=spec.moe_ffn_hidden_size or 0, shared_ffn=spec.moe_shared_ffn_hidden_size or 0,
                   mla_kv_rows=None if mla is None else mla.kv_lora_rank + mla.qk_rope_head_dim,
                   q_lora_rank=None if mla is None else mla.q_lora_rank)


def padded_vocab(vocab: int, tp: int) -> int:
    """Rows of Megatron's embedding / output layer: a multiple of tp (and of 128 * tp for real
    vocabularies, for GEMM efficiency); padding rows are masked out of every log-prob."""
    multiple = tp * (128 if vocab >= 4096 else 1)
    return -(-vocab // multiple) * multiple


def check_model(model: ModelShape, layout: ParallelLayout, *, training: bool = False) -> None:
    """Refuse a layout `model` cannot be split into (ValueError: one line, the key and the arithmetic).
    training=True adds what megarl's trainer cannot run yet (module docstring)."""
    tp, etp = layout.tp, layout.expert_tp
    divides = [(model.heads, "parallel.tp", tp, "attention heads"), (model.kv_heads, "parallel.tp", tp, "key/value heads")]
    if model.mla_kv_rows is not None:
        # Megatron's local MLA splits the down projections' output rows over tp (and gathers them).
        divides.append((model.mla_kv_rows, "parallel.tp", tp, "MLA key/value latent rows (kv_lora_rank + qk_rope_head_dim)"))
        if model.q_lora_rank:
            divides.append((model.q_lora_rank, "parallel.tp", tp, "MLA query latent rows (q_lora_rank)"))
    divides.append((model.ffn, "parallel.tp", tp, "ffn width (intermediate_size)"))
    if model.is_moe:
        divides += [(model.experts, "parallel.ep", layout.ep, "routed experts"),
                    (model.moe_ffn, "parallel.etp", etp, "expert ffn width")]
        if model.shared_ffn:
            divides.append((model.shared_ffn, "parallel.tp", tp, "shared-expert ffn width"))
    elif layout.ep > 1:
        raise ValueError(f"parallel.ep = {layout.ep} needs a mixture-of-experts model; this {model.name} model is dense")
    for count, key, size, what in divides:
        if count % size:
            raise ValueError(f"{key} = {size} does not divide the model's {count} {what} ({model.name})")
    try:
        layout.stage_layers(model.num_layers)
    except ValueError as err:
        raise ValueError(f"parallel.pp / first_stage_layers / last_stage_layers / vpp: {err} ({model.name})") from None
    if training:
        check_training(model, layout)


def check_rollout_heads(model: ModelShape, rollout_tp: int) -> None:
    """The rollout engine (vLLM, SGLang) splits attention heads over rollout.tp: the query heads must
    divide, the key/value heads divide or be replicated (rollout.tp a multiple of them). ValueError:
    one line naming rollout.tp and the arithmetic; found by the dry run, refused before any model."""
    if model.heads % rollout_tp:
        raise ValueError(f"rollout.tp = {rollout_tp} does not divide the model's {model.heads} attention heads "
                         f"({model.name}); choose a rollout.tp that divides {model.heads}")
    if model.kv_heads % rollout_tp and rollout_tp % model.kv_heads:
        raise ValueError(f"rollout.tp = {rollout_tp} neither divides the model's {model.kv_heads} key/value heads nor is a "
                         f"multiple of them ({model.name}); choose a rollout.tp that does")


def check_training(model: ModelShape, layout: ParallelLayout) -> None:
    """What megarl's trainer refuses although Megatron-Core could build it."""
    if model.is_moe:
        refuse_moe_tensor_parallel(layout.tp, f"a {model.name} mixture-of-experts model", layout.sequence_parallel)
    if layout.vpp and model.tie_embeddings:
        raise ValueError(f"parallel.vpp = {layout.vpp} with a model whose embeddings are tied ({model.name}): Megatron-Core's "
                         f"optimizer checkpoint does not restore this combination correctly; use parallel.vpp=null")


def refuse_moe_tensor_parallel(tp: int, model: str, sequence_parallel: bool) -> None:
    """MoE training at parallel.tp > 1 without sequence parallelism is refused: Megatron-Core's MoE
    layer refuses it in training (0.16 to 0.19), and with that guard lifted every TP rank holds the
    whole sequence and the token dispatcher gathers it once per TP rank, so each expert sees every
    token tp times and its gradient comes out tp times too large (measured: tests/moe). With
    sequence parallelism each TP rank routes its own s/tp tokens and the gradients are exact.
    Forward-only tools (megarl.tools.logprobs) may use either."""
    if tp > 1 and not sequence_parallel:
        raise ValueError(f"parallel.tp = {tp} with {model} and parallel.sequence_parallel=false: MoE training at tp > 1 "
                         f"needs sequence parallelism (without it every expert gradient is tp times too large); set "
                         f"parallel.sequence_parallel=true (the default), or use parallel.tp=1 and split the model with "
                         f"parallel.ep / parallel.etp / parallel.pp")
