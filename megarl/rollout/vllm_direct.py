"""Weight sync into vLLM at the bound: each rank's rollout shard, written into vLLM's own parameters.

vLLM's `load_weights` / `reload_weights` take full HF tensors and slice them per rank, so through
them every rank receives (almost) the whole model. For the dense families (llama, qwen2, qwen3)
this module instead has the 3D-HybridEngine deliver each rank exactly the slice its vLLM
parameters hold (HybridEngine with `RolloutLayout(tp=T, grouping="consecutive")`: vLLM's TP groups
are blocks of T consecutive ranks, TP rank r % T) and writes it straight into them:
  - linear_qkv ([q heads; k; v] per query group, Megatron) -> qkv_proj ([all q; all k; all v] of
    this rank's heads, vLLM): a local de-interleave, the same heads on both sides;
  - linear_fc1 ([gate; up] shards) -> gate_up_proj: the same layout; o_proj, down_proj: columns;
  - embedding / output layer -> VocabParallelEmbedding / ParallelLMHead: vLLM pads the vocabulary
    to its own multiple (64) and splits *that* evenly, so its shard boundaries are not the
    trainer's; the plan asks for exactly vLLM's rows (`RolloutLayout.rows`), the padding rows
    are zeros written here (vLLM never reads them: logits are cut to the real vocabulary);
  - norms, q/k norms: whole.
After a module's tensors are written, its quant method's `process_weights_after_loading` runs
again, as vLLM's own reload does: on CPU it repacks the weight into oneDNN's layout (and drops the
plain one), on CUDA it is a no-op for unquantized layers. Anything else (MoE, quantized layers,
kv heads vLLM replicates, an unknown parameter) keeps the full-tensor path; `choose` says which
path runs and why, the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from megarl.layout import RolloutLayout
from megarl.models.families import ModelSpec

DIRECT_FAMILIES = ("llama", "qwen2", "qwen3")
_UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class Target:
    """Where one canonical Megatron tensor goes in vLLM on a rank: its parameter and shard shape.

    kind: "copy" (same layout), "qkv" (de-interleave query groups), "vocab" (pad to vLLM's rows).
    """

    param: str
    shape: tuple[int, ...]
    kind: str = "copy"


def vocab_rows(vocab: int, org_vocab_padded: int, tp: int) -> tuple[tuple[int, int], ...]:
    """Real vocabulary rows each vLLM TP rank holds (VocabParallelEmbedding's shard_indices)."""
    per = org_vocab_padded // tp
    return tuple((min(q * per, vocab), min((q + 1) * per, vocab)) for q in range(tp))


def direct_targets(spec: ModelSpec, tp: int, org_vocab_padded: int) -> dict[str, Target]:
    """Canonical Megatron name -> vLLM parameter and its shard shape on every rank of a TP-`tp` engine."""
    h, d, T = spec.hidden_size, spec.head_dim, tp
    heads, kv, f = spec.num_heads // T, spec.num_kv_heads // T, spec.ffn_hidden_size // T
    qkv_rows = (heads + 2 * kv) * d
    out = {"embedding.word_embeddings.weight": Target("model.embed_tokens.weight", (org_vocab_padded // T, h), "vocab")}
    for i in range(spec.num_layers):
        mc, v = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[mc + "input_layernorm.weight"] = Target(v + "input_layernorm.weight", (h,))
        out[mc + "self_attention.linear_qkv.weight"] = Target(v + "self_attn.qkv_proj.weight", (qkv_rows, h), "qkv")
        if spec.qkv_bias:
            out[mc + "self_attention.linear_qkv.bias"] = Target(v + "self_attn.qkv_proj.bias", (qkv_rows,), "qkv")
        if spec.qk_norm:
            out[mc + "self_attention.q_layernorm.weight"] = Target(v + "self_attn.q_norm.weight", (d,))
            out[mc + "self_attention.k_layernorm.weight"] = Target(v + "self_attn.k_norm.weight", (d,))
        out[mc + "self_attention.linear_proj.weight"] = Target(v + "self_attn.o_proj.weight", (h, heads * d))
        out[mc + "pre_mlp_layernorm.weight"] = Target(v + "post_attention_layernorm.weight", (h,))
        out[mc + "mlp.linear_fc1.weight"] = Target(v + "mlp.gate_up_proj.weight", (2 * f, h))
        out[mc + "mlp.linear_fc2.weight"] = Target(v + "mlp.down_proj.weight", (h, f))
    out["decoder.final_layernorm.weight"] = Target("model.norm.weight", (h,))
    if not spec.tie_embeddings:  # tied: vLLM's lm_head *is* the embedding parameter
        out["output_layer.weight"] = Target("lm_head.weight", (org_vocab_padded // T, h), "vocab")
    return out


def make_converter(spec: ModelSpec, tp: int, org_vocab_padded: int) -> Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]:
    """(canonical name, this rank's rollout shard) -> [(vLLM parameter name, tensor in vLLM's layout)]."""
    targets = direct_targets(spec, tp, org_vocab_padded)
    q_per_group, d = spec.num_heads // spec.num_kv_heads, spec.head_dim

    def convert(name: str, shard: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        target = targets.get(name)
        if target is None:
            raise KeyError(f"{name} has no place in vLLM's {spec.family} model on the direct weight path"
                           + (" (a tied output layer is the embedding: stream it once)" if name == "output_layer.weight" else ""))
        if target.kind == "qkv":  # rows: per local query group [q_per_group heads; k; v], each d rows
            groups = shard.view(-1, q_per_group + 2, d, *shard.shape[1:])
            q = groups[:, :q_per_group].reshape(-1, *shard.shape[1:])
            k, v = groups[:, q_per_group], groups[:, q_per_group + 1]
            shard = torch.cat([q, k.reshape(-1, *shard.shape[1:]), v.reshape(-1, *shard.shape[1:])])
        elif target.kind == "vocab" and shard.shape[0] < target.shape[0]:
            shard = torch.cat([shard, shard.new_zeros((target.shape[0] - shard.shape[0],) + tuple(shard.shape[1:]))])
        if tuple(shard.shape) != target.shape:
            raise ValueError(f"{name}: rollout shard {tuple(shard.shape)} does not fit vLLM's {target.param} {target.shape}")
        return [(target.param, shard)]

    return convert


# --- the vLLM side (runs inside vLLM's worker through LLM.collective_rpc; in-process with external_launcher)


def _model(worker):
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def _logical_shape(module, pname: str, param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape before vLLM's post-load processing (on CPU, linear weights are packed
    away into oneDNN and the parameter left empty)."""
    if hasattr(module, "output_size_per_partition") and hasattr(module, "input_size_per_partition"):
        if pname == "weight":
            return (module.output_size_per_partition, module.input_size_per_partition)
        if pname == "bias":
            return (module.output_size_per_partition,)
    return tuple(param.shape)


def describe_model(worker) -> dict:
    """What the direct path needs to know of this rank's vLLM model (picklable)."""
    # deferred: optional (vllm extra)
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    model = _model(worker)
    params, quant, vocab = {}, {}, {}
    for mname, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if own and getattr(module, "quant_method", None) is not None:
            quant[mname] = type(module.quant_method).__name__
        if mname == "model.embed_tokens":
            idx = module.shard_indices
            vocab = dict(org_padded=module.org_vocab_size_padded, padded=module.num_embeddings_padded,
                         rows=(idx.org_vocab_start_index, idx.org_vocab_end_index))
    for name, param in model.named_parameters():  # shared (tied) parameters once
        mname, pname = name.rpartition(".")[::2]
        params[name] = _logical_shape(model.get_submodule(mname), pname, param)
    return dict(model_class=type(model).__name__, tp_rank=get_tensor_model_parallel_rank(),
                tp_size=get_tensor_model_parallel_world_size(), params=params, quant=quant, vocab=vocab)


def config_problem(spec: ModelSpec, tp: int) -> str | None:
    """Why the direct path cannot apply to this model at rollout tp `tp`, from its config.json alone
    (None: it may; `direct_problem` then asks vLLM's own model). The dry run decides with this too."""
    if spec.family not in DIRECT_FAMILIES or spec.is_moe:
        return f"the {spec.family} family (the direct path covers the dense {', '.join(DIRECT_FAMILIES)})"
    if spec.num_kv_heads % tp or spec.num_heads % tp or spec.ffn_hidden_size % tp:
        return f"{spec.num_kv_heads} kv heads / {spec.num_heads} heads / ffn {spec.ffn_hidden_size} not divisible by rollout tp {tp} (vLLM replicates kv heads)"
    return None


def direct_problem(spec: ModelSpec, tp: int, rank: int, desc: dict) -> str | None:
    """Why the direct path cannot serve this rank's vLLM model (None: it can)."""
    if (problem := config_problem(spec, tp)) is not None:
        return problem
    if (desc["tp_size"], desc["tp_rank"]) != (tp, rank % tp):
        return f"vLLM placed rank {rank} at TP rank {desc['tp_rank']} of {desc['tp_size']}, not {rank % tp} of {tp}"
    odd = sorted(m for m, q in desc["quant"].items() if q not in _UNQUANTIZED)
    if odd:
        return f"quantized or unknown layer kinds ({desc['quant'][odd[0]]} at {odd[0]})"
    vocab = desc["vocab"]
    if not vocab or vocab["padded"] != vocab["org_padded"]:
        return "vLLM's embedding has added (LoRA) vocabulary rows"
    if tuple(vocab["rows"]) != vocab_rows(spec.vocab_size, vocab["org_padded"], tp)[rank % tp]:
        return f"vLLM's vocabulary shard {vocab['rows']} is not the even split of {vocab['org_padded']} rows"
    want = {t.param: t.shape for t in direct_targets(spec, tp, vocab["org_padded"]).values()}
    have = {name: tuple(shape) for name, shape in desc["params"].items()}
    if want != have:
        diff = sorted(set(want) ^ set(have)) or sorted(n for n in want if want[n] != have[n])
        n = diff[0]
        return f"vLLM's {desc['model_class']} parameters differ from the direct table at {n} (vLLM {have.get(n)}, table {want.get(n)})"
    return None


@torch.no_grad()
def write_shards(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Write (vLLM parameter name, shard) pairs into this rank's model; returns the bytes written.

    A module is written once all its parameters arrived (qkv_proj: weight and bias), then every
    module holding one of them (a tied lm_head holds the embedding) re-runs its post-load step.
    """
    model = _model(worker)
    holders: dict[int, list] = {}
    for module in model.modules():
        for _, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append(module)
    expected = {name for name, _ in model.named_parameters()}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    written, nbytes = set(), 0
    for name, tensor in weights:
        if name not in expected or name in written:
            raise RuntimeError(f"direct weight sync: {name} is {'written twice' if name in written else 'not a parameter of the vLLM model'}")
        mname, pname = name.rpartition(".")[::2]
        module = model.get_submodule(mname)
        own = {n for n, _ in module.named_parameters(recurse=False) if f"{mname}.{n}" in expected}
        got = pending.setdefault(mname, {})
        got[pname] = tensor if own == {pname} else tensor.detach().clone()  # stream tensors live one item
        if set(got) != own:
            continue
        del pending[mname]
        to_process = []
        for pname, t in got.items():
            param = getattr(module, pname)
            for m in holders.get(id(param), [module]):
                if m not in to_process:
                    to_process.append(m)
            if tuple(param.shape) == tuple(t.shape):
                param.data.copy_(t)  # in place: CUDA graphs and tied modules keep pointing at it
            else:  # packed away after loading (vLLM on CPU): a fresh parameter, packed again below
                module.register_parameter(pname, torch.nn.Parameter(t.to(param.dtype).clone(), requires_grad=False))
            nbytes += t.numel() * t.element_size()
            written.add(f"{mname}.{pname}")
        for m in to_process:
            if getattr(m, "quant_method", None) is not None:
                m.quant_method.process_weights_after_loading(m)
    missing = sorted(expected - written)
    if missing or pending:
        raise RuntimeError(f"direct weight sync left {len(missing)} vLLM parameter(s) unwritten, e.g. {missing[:3]}: "
                           "the stream must cover the whole model")
    return nbytes


# --- choosing the path (collective over the default group: every rank must agree) -----------------


@dataclass(frozen=True)
class DirectPath:
    """The direct path for one engine: the layout the HybridEngine delivers and the converter."""

    layout: object  # megarl.layout.RolloutLayout
    convert: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]


def choose(engine, spec: ModelSpec, tp: int) -> DirectPath | str:
    """The direct path if it serves every rank's vLLM model, else why not (the same on every rank)."""
    rank = dist.get_rank()
    try:  # a failure here must not leave the other ranks waiting in the all-gather
        desc = engine.describe_model()
        mine = (direct_problem(spec, tp, rank, desc), desc["vocab"].get("org_padded"))
    except Exception as e:  # an engine version whose internals differ: the full path still works
        mine = (f"could not read vLLM's model ({type(e).__name__}: {e})", None)
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, mine)
    for r, (problem, _) in enumerate(problems):
        if problem is not None:
            return f"rank {r}: {problem}"
    org_padded = problems[0][1]
    rows = vocab_rows(spec.vocab_size, org_padded, tp)
    layout = RolloutLayout(tp=tp, grouping="consecutive", rows=tuple((name, rows) for name in VOCAB_TENSORS))
    return DirectPath(layout, make_converter(spec, tp, org_padded))
