"""LoRA adapters on Megatron-Core's column- and row-parallel linear layers.

An adapter adds `scale * B @ A @ x` (scale = alpha / rank, PEFT's) to a linear layer's output,
with A [rank, in] and B [out, rank] per *HF projection*: Megatron fuses q/k/v into `linear_qkv` and
gate/up into `linear_fc1`, so a fused layer holds one (A, B) pair per HF projection it contains
(`q_proj`, `k_proj`, `v_proj`), exactly PEFT's parameters, and its output delta is laid out the
way Megatron lays out the fused weight (per query group [q; k; v], or [gate; up]).

Sharding follows the base weight so every layout computes one process's result:
  column-parallel (out split over TP): B's rows are split as the weight's rows; A is replicated.
    h = A x is made a TP "copy" (identity forward, all-reduce backward), so A's gradient and the
    input gradient through the adapter are complete on every TP rank.
  row-parallel (in split over TP): A's columns are split as the weight's columns; B is replicated.
    h = sum over TP of A_i x_i (all-reduce forward, identity backward), then B h.
  expert layers (`explicit_expert_comm`: the MoE dispatcher gathers inputs and sums outputs over the
    expert-TP group itself): no collective inside the layer; the replicated factor's gradient is
    partial per expert-TP rank and a gradient hook sums it over that group. The row-parallel delta
    stays a partial sum, like the layer's own output, so the dispatcher's sum counts it once
    (the "shared-expert delta counted tp times" bug of the peers is this case done wrong).
Adapters are initialised from the *global* tensor (seeded by the global parameter name) and then
sliced, so they are the same numbers under every layout. B starts at zero (PEFT's default): the
policy starts as the base model.

Base weights are frozen (`freeze_base`) before DDP wraps the model, so Megatron's DDP gives them
no gradient buffer and its optimizer neither a float32 main copy nor Adam state.

It is long because the adapter's forward, its sharding rules per layer kind (column, row, expert)
and the merge for export and weight sync must agree with one another: split apart, a change to one
rule would silently leave the others computing another layout's numbers.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass
import json
from pathlib import Path
import re
from typing import Iterator

from safetensors.torch import save_file
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarl.models.lora_peft import moe_layout, peft_tensors
from megarl.models.lora_targets import ATTENTION_PROJECTIONS, check_targets, known_modules
from megarl.models.weights import _layer_offset, global_name, model_chunks, named_global_parameters

@dataclass(frozen=True)
class LoraOptions:
    """One role's adapters. rank 0 = LoRA off. target_modules: HF projection names (None = every
    linear layer of the decoder: attention, MLP, MLA and experts; never the router or LM head)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None
    seed: int = 0
    key: str = "actor.lora"  # the config section, for messages

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _projections(module_name: str, spec) -> tuple[tuple[str, ...], str] | None:
    """(HF projections, how they are fused: 'one' | 'qkv' | 'cat') of a Megatron linear, or None."""
    for suffix, names in ATTENTION_PROJECTIONS.items():
        if module_name.endswith(suffix):
            return names, ("qkv" if len(names) == 3 else "one")
    expert = ".mlp.experts.local_experts." in module_name
    n = spec.hf_names
    gate, up, down = (n.expert_gate, n.expert_up, n.expert_down) if expert else ("gate_proj", "up_proj", "down_proj")
    if module_name.endswith("linear_fc1"):
        return (gate, up), "cat"
    if module_name.endswith("linear_fc2"):
        return (down,), "one"
    return None


def _kind(module) -> str:
    """'column' or 'row' from Megatron's (or Transformer-Engine's) parallel linear classes."""
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    mode = getattr(module, "parallel_mode", None)  # TE linears: "column" | "row" | None (duplicated)
    if mode in ("column", "row"):
        return mode
    raise TypeError(f"LoRA cannot wrap {type(module).__name__}: not a column- or row-parallel linear")


class LoraAdapter(torch.nn.Module):
    """The adapters of one Megatron linear layer (`<linear>.lora.<hf projection>.lora_A/lora_B`).

    Built on this rank's shard sizes; `full_shapes` are the global [out, in] of each projection."""

    def __init__(self, linear, names: tuple[str, ...], fused: str, targets: set[str], out_sizes: list[int], in_size: int,
                 options: LoraOptions, global_name: str, head_dim: int | None):
        super().__init__()
        self.kind, self.fused, self.names, self.head_dim = _kind(linear), fused, names, head_dim
        group = linear.tp_group if getattr(linear, "tp_group", None) is not None else None
        self.group = group
        self.tp_size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        self.tp_rank = dist.get_rank(group) if self.tp_size > 1 else 0
        self.explicit = bool(getattr(linear, "explicit_expert_comm", False))
        self.gather_output = bool(getattr(linear, "gather_output", False))
        # Under sequence parallelism a dense column-parallel layer receives this rank's s/tp tokens and
        # all-gathers them itself; a row-parallel one reduce-scatters its output to s/tp tokens.
        self.sequence_parallel = bool(getattr(linear, "sequence_parallel", False)) and self.tp_size > 1 and not self.explicit
        self.scale, self.enabled = options.scale, True
        self.dropout = torch.nn.Dropout(options.dropout) if options.dropout > 0 else torch.nn.Identity()
        self.out_sizes = out_sizes  # full output rows of each projection
        self.in_size = in_size  # full input columns
        weight = linear.weight
        self.adapters = torch.nn.ModuleDict()
        for name, out in zip(names, out_sizes):
            if name not in targets:
                continue
            a_full, b_full = _init(options, f"{global_name}.{name}", out, in_size)
            part = torch.nn.Module()
            if self.kind == "column":
                a, b = a_full, b_full.chunk(self.tp_size, 0)[self.tp_rank]
            else:
                a, b = a_full.chunk(self.tp_size, 1)[self.tp_rank], b_full
            part.lora_A = torch.nn.Parameter(a.to(weight.dtype).to(weight.device).contiguous())
            part.lora_B = torch.nn.Parameter(b.to(weight.dtype).to(weight.device).contiguous())
            self._tag(part, weight)
            self.adapters[name] = part

    def _tag(self, part, weight) -> None:
        """Megatron's attributes: which factor is TP-split, which are expert parameters (reduced over
        the expert-DP group), and which copies the gradient norm counts once."""
        # deferred: megatron (seconds to import) loads only when this runs
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        sharded, replicated = (part.lora_B, part.lora_A) if self.kind == "column" else (part.lora_A, part.lora_B)
        expert = not getattr(weight, "allreduce", True)
        if self.tp_size > 1 or expert:
            set_tensor_model_parallel_attributes(sharded, True, 0 if self.kind == "column" else 1, 1)
        if expert:
            # Megatron's grad norm counts a non-TP parameter on *dense* TP rank 0 only, which says
            # nothing about the expert-TP group: count the replicated factor on every rank, except
            # where it is a copy of expert-TP rank 0's (`shared`: counted elsewhere, as a tied head).
            set_tensor_model_parallel_attributes(replicated, True, 0, 1)
            if self.tp_rank > 0:
                replicated.shared = True
        if self.sequence_parallel:
            # The replicated factor sees only this rank's s/tp tokens (column: A's input; row: B's),
            # so its gradient is a partial sum: finalize_model_grads sums such parameters over TP.
            replicated.sequence_parallel = True
        for p in (part.lora_A, part.lora_B):
            if hasattr(weight, "allreduce"):  # expert parameters: reduced over the expert-DP group
                p.allreduce = weight.allreduce
            p.is_lora = True
        if self.explicit and self.tp_size > 1:
            group = self.group

            def summed(grad, group=group):
                grad = grad.clone()
                dist.all_reduce(grad, group=group)
                return grad

            replicated.register_hook(summed)

    def local_out_sizes(self) -> list[int]:
        return [o // self.tp_size for o in self.out_sizes] if self.kind == "column" else list(self.out_sizes)

    def _assemble(self, parts: list[torch.Tensor | None], lead: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """The projections' [..., out_p] deltas laid out as the fused Megatron weight's rows."""
        sizes = self.local_out_sizes()
        parts = [p if p is not None else like.new_zeros(lead + (n,)) for p, n in zip(parts, sizes)]
        if self.fused == "one":
            return parts[0]
        if self.fused == "cat":
            return torch.cat(parts, -1)
        groups = sizes[1] // self.head_dim  # qkv: per query group [q heads; k; v]
        return torch.cat([p.reshape(lead + (groups, -1)) for p in parts], -1).reshape(lead + (-1,))

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' contribution to the layer's output (same sharding as the output)."""
        # deferred: megatron (seconds to import) loads only when this runs
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
            gather_from_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )

        x = self.dropout(x)
        present = [n for n in self.names if n in self.adapters]
        a = torch.cat([self.adapters[n].lora_A for n in present], 0)
        h = F.linear(x, a)  # [..., rank * projections]
        if self.sequence_parallel:  # as the layer does with x / its output, on the rank-wide h
            h = (gather_from_sequence_parallel_region(h, group=self.group) if self.kind == "column"
                 else reduce_scatter_to_sequence_parallel_region(h, group=self.group))
        elif self.tp_size > 1 and not self.explicit:
            h = (copy_to_tensor_model_parallel_region(h, group=self.group) if self.kind == "column"
                 else reduce_from_tensor_model_parallel_region(h, group=self.group))
        hs = dict(zip(present, h.chunk(len(present), -1)))
        lead = tuple(h.shape[:-1])  # the output's tokens: all of them, or s/tp under sequence parallelism
        parts = [F.linear(hs[n], self.adapters[n].lora_B) * self.scale if n in hs else None for n in self.names]
        out = self._assemble(parts, lead, h)
        if self.kind == "column" and self.gather_output and self.tp_size > 1:
            out = gather_from_tensor_model_parallel_region(out, group=self.group)
        return out

    def weight_delta(self) -> torch.Tensor:
        """scale * B @ A of this rank's shard of the fused weight, computed in float32."""
        sizes = self.local_out_sizes()
        in_local = self.in_size // self.tp_size if self.kind == "row" else self.in_size
        parts = []
        for n, _rows in zip(self.names, sizes):
            if n not in self.adapters:
                parts.append(None)
                continue
            p = self.adapters[n]
            parts.append((p.lora_B.float() @ p.lora_A.float()).t() * self.scale)  # [in, out_p]
        ref = next(iter(self.adapters.values())).lora_A
        like = torch.zeros((), dtype=torch.float32, device=ref.device)
        return self._assemble(parts, (in_local,), like).t()


def _init(options: LoraOptions, name: str, out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's initialisation of the global tensors: A ~ kaiming-uniform(a=sqrt(5)), i.e. U(+-1/sqrt(in)),
    B = 0; seeded by the global name, so every layout draws the same numbers."""
    g = torch.Generator().manual_seed(options.seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(inp)
    a = (torch.rand(options.rank, inp, generator=g, dtype=torch.float32) * 2 - 1) * bound
    return a, torch.zeros(out, options.rank)


def _rms_input(linear, x: torch.Tensor) -> torch.Tensor:
    """Transformer-Engine's norm-fused linears receive the un-normalised input: normalise as they do."""
    w = linear.layer_norm_weight
    if getattr(linear, "zero_centered_gamma", False):
        w = w + 1
    if getattr(linear, "normalization", "RMSNorm") != "RMSNorm":
        raise NotImplementedError("LoRA on a LayerNorm-fused linear needs RMSNorm")
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + linear.eps)).to(x.dtype) * w


def _hook(module, args, output):
    adapter = getattr(module, "lora", None)
    if adapter is None or not adapter.enabled:
        return output
    x = args[0]
    if hasattr(module, "layer_norm_weight"):
        x = _rms_input(module, x)
    out, bias = output if isinstance(output, tuple) else (output, None)
    out = out + adapter.delta(x).to(out.dtype)
    return (out, bias) if isinstance(output, tuple) else out


def _sizes(linear, names: tuple[str, ...], spec, kind: str, tp_size: int) -> tuple[list[int], int]:
    """Full output rows of each projection and the full input width of a Megatron linear."""
    out_local, in_local = linear.weight.shape
    out_full, in_full = (out_local * tp_size, in_local) if kind == "column" else (out_local, in_local * tp_size)
    if len(names) == 3:  # q, k, v
        d = spec.head_dim
        return [spec.num_heads * d, spec.num_kv_heads * d, spec.num_kv_heads * d], in_full
    return [out_full // len(names)] * len(names), in_full


def attach(chunk: torch.nn.Module, spec, options: LoraOptions, layer_offset: int, expert_offset: int) -> int:
    """Add adapters to every targeted linear of one model chunk (before DDP); returns how many."""
    targets = set(options.target_modules or known_modules(spec))
    count = 0
    for name, module in list(chunk.named_modules()):
        found = _projections(name, spec)
        if found is None or not hasattr(module, "weight") or name.endswith("router"):
            continue
        names, fused = found
        if not targets & set(names):
            continue
        kind = _kind(module)
        if kind == "row" and not getattr(module, "input_is_parallel", True):
            raise NotImplementedError(f"LoRA on {name}: a row-parallel linear without input_is_parallel")
        group = getattr(module, "tp_group", None)
        tp_size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        out_sizes, in_size = _sizes(module, names, spec, kind, tp_size)
        glob = global_name(name + ".weight", layer_offset, expert_offset)[: -len(".weight")]
        module.lora = LoraAdapter(module, names, fused, targets, out_sizes, in_size, options, glob, spec.head_dim)
        # prepend: before megarl.models.sequence_parallel's relayout of MLA's kv down projection,
        # so the delta is added to the column-parallel output it is computed for
        module.register_forward_hook(_hook, prepend=True)
        count += 1
    return count


def apply(chunks: list, spec, dims, options: LoraOptions) -> int:
    """Adapters on every chunk of this rank (global layer and expert numbering), base frozen."""
    check_targets(options.target_modules, spec, options.key)
    experts_per_rank = spec.num_experts // dims.ep if spec.is_moe else 0
    count = 0
    for chunk in chunks:
        count += attach(chunk, spec, options, _layer_offset(chunk), dims.ep_rank * experts_per_rank)
        freeze_base(chunk)
    return count


def freeze_base(chunk: torch.nn.Module) -> None:
    """Only the adapters (and a critic's value head) train: everything else stops needing gradients."""
    for name, p in chunk.named_parameters():
        if getattr(p, "is_lora", False) or getattr(getattr(chunk, "output_layer", None), "is_value_head", False) and \
                name.startswith("output_layer."):
            continue
        p.requires_grad_(False)


def adapters(chunks) -> Iterator[tuple[str, torch.nn.Module, LoraAdapter]]:
    """(module name, linear, adapter) of every adapted linear in `chunks` (unwrapped)."""
    for chunk in model_chunks(chunks):
        for name, module in chunk.named_modules():
            if isinstance(getattr(module, "lora", None), LoraAdapter):
                yield name, module, module.lora


@contextlib.contextmanager
def disabled(chunks):
    """The base model: every adapter off (the reference policy for free)."""
    found = [a for _, _, a in adapters(chunks)]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a in found:
            a.enabled = True


def merged_weight(module) -> torch.Tensor:
    """This rank's shard of W + scale * B @ A: merged in float32, then cast to the weight's dtype
    (merging on the bf16 grid first would round a small update away)."""
    return (module.weight.float() + module.lora.weight_delta()).to(module.weight.dtype)


def merged_weights(chunks, spec, dims) -> dict[str, torch.Tensor]:
    """Global name -> this rank's merged shard of every adapted weight (the full-weight sync and the
    merged export; engines without LoRA support get these)."""
    names = {id(p): name for name, _, p in named_global_parameters(chunks, spec, dims)}
    with torch.no_grad():
        return {names[id(module.weight)]: merged_weight(module) for _, module, _ in adapters(chunks)}


def merged_shards(chunks, spec, dims, shards: dict) -> dict:
    """`local_weight_shards` with the adapted weights replaced by their merged shards."""
    out = dict(shards)
    for name, tensor in merged_weights(chunks, spec, dims).items():
        out[name] = (tensor, shards[name][1])
    return out


def hf_module_name(module_name: str, projection: str, spec) -> str:
    """The HF (and PEFT) module of one projection of a Megatron linear, by global module name:
    decoder.layers.3.self_attention.linear_qkv + k_proj -> model.layers.3.self_attn.k_proj."""
    layer = int(re.match(r"decoder\.layers\.(\d+)\.", module_name).group(1))
    prefix = f"model.layers.{layer}."
    if ".self_attention." in module_name:
        return f"{prefix}self_attn.{projection}"
    expert = re.search(r"\.mlp\.experts\.local_experts\.(\d+)\.", module_name)
    if expert:
        return f"{prefix}{spec.hf_names.moe_block}.experts.{int(expert.group(1))}.{projection}"
    if ".mlp.shared_experts." in module_name:
        return f"{prefix}{spec.hf_names.moe_block}.shared_experts.{projection}"
    return f"{prefix}mlp.{projection}"


def full_adapters(chunks, spec, dims) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module name -> (A [rank, in], B [out, rank]) of the whole model, on every rank (collective):
    each rank's shards are gathered and the TP-split factor concatenated (small: rank x width)."""
    experts_per_rank = spec.num_experts // dims.ep if spec.is_moe else 0
    local = []
    for chunk in model_chunks(chunks):
        offset = _layer_offset(chunk)
        for name, module in chunk.named_modules():
            adapter = getattr(module, "lora", None)
            if not isinstance(adapter, LoraAdapter):
                continue
            glob = global_name(name + ".weight", offset, dims.ep_rank * experts_per_rank)[: -len(".weight")]
            for proj, part in adapter.adapters.items():
                local.append((hf_module_name(glob, proj, spec), adapter.kind, adapter.tp_rank, adapter.tp_size,
                              part.lora_A.detach().float().cpu(), part.lora_B.detach().float().cpu()))
    gathered = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
    shards: dict[str, dict] = {}
    for name, kind, rank, size, a, b in (item for part in gathered for item in part):
        shards.setdefault(name, {"kind": kind, "size": size, "parts": {}})["parts"][rank] = (a, b)
    out = {}
    for name, s in sorted(shards.items()):
        parts = [s["parts"][r] for r in range(s["size"])]
        if s["kind"] == "column":
            out[name] = (parts[0][0], torch.cat([b for _, b in parts], 0))
        else:
            out[name] = (torch.cat([a for a, _ in parts], 1), parts[0][1])
    return out


def peft_config(options: LoraOptions, modules, base_model: str) -> dict:
    """PEFT's adapter_config.json for adapters on `modules` (full HF module names, not projection
    names: PEFT turns bare MoE names (gate_proj, ...) into targets on transformers' fused experts
    and then skips the dense and shared-expert MLPs; a MoE model's MLP adapters are parameter
    targets instead, megarl.models.lora_peft)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
            "r": options.rank, "lora_alpha": options.alpha, "lora_dropout": options.dropout,
            "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}


def moe_mlp_adapters(adapters, spec) -> list[str]:
    """MLP adapters of a MoE model: the adapter-only sync to vLLM does not take them (its layout for
    MoE LoRA is unverified here); the PEFT export writes them in transformers 5's fused-expert
    layout (megarl.models.lora_peft), which only peft loads."""
    return [n for n in adapters if spec.is_moe and ".self_attn." not in n]  # Mixtral's: block_sparse_moe


def _fused_experts() -> bool:
    """transformers 5 fuses a MoE layer's experts into 3-D parameters; 4.x keeps one nn.Linear per
    expert (experts.N.gate_proj), which PEFT adapts as modules like any dense linear."""
    import transformers  # deferred: transformers (seconds to import) loads only when this runs

    return int(transformers.__version__.split(".")[0]) >= 5


def save_peft_adapter(chunks, spec, dims, options: LoraOptions, out_dir, base_model: str) -> dict[str, int]:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) that
    `peft.PeftModel.from_pretrained(<base HF model>, out_dir)` loads: the names are the HF modules'
    (`base_model.model.<module>.lora_A.weight`), never Megatron's fused ones. MLP adapters of a MoE
    model go in transformers 5's fused-expert layout (megarl.models.lora_peft). Collective; rank 0 writes."""
    tensors = full_adapters(chunks, spec, dims)
    if moe_mlp_adapters(tensors, spec) and _fused_experts():
        layout = moe_layout(tensors, spec, options.rank, options.alpha)
        state = layout["tensors"]
        config = peft_config(options, layout["target_modules"], base_model)
        # peft's ParamWrapper refuses dropout (x cannot be factored out of a parametrized weight);
        # dropout is the identity at inference, so the loaded model computes the same
        config.update(target_parameters=layout["target_parameters"], rank_pattern=layout["rank_pattern"],
                      alpha_pattern=layout["alpha_pattern"], lora_dropout=0.0)
    else:
        state, config = peft_tensors(tensors), peft_config(options, tensors, base_model)
    if dims.rank == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        (out / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")
    if dist.is_initialized():
        dist.barrier()
    return {"adapters": len(tensors)}
