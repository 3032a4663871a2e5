"""PEFT's names of the adapters (`peft_tensors`: what the PEFT export writes and the adapter-only sync
sends to vLLM) and PEFT's layout of a MoE model's MLP adapters under transformers 5 (the
`--adapter-only` export).

transformers 5 fuses a MoE layer's routed experts into two 3-D parameters,
`model.layers.L.mlp.experts.gate_up_proj` [E, 2f, h] and `...experts.down_proj` [E, h, f] (Mixtral's
`block_sparse_moe.experts.N.w1/w3/w2` included), so PEFT adapts them as parameters
(`target_parameters`, peft's `ParamWrapper`), not as modules. Per-expert LoRA fits that exactly:
a ParamWrapper on an [E, out, in] parameter holds lora_A [E*r', in] (expert e's A = rows e*r'..)
and lora_B [out, r'*E] (expert e's B = columns e, E+e, 2E+e, ..: `reshape(out, r', E)`), and adds
scaling * B_e @ A_e to expert e. gate and up share one fused parameter, so their adapters become one
of rank 2r: A = [A_gate; A_up], B = blockdiag(B_gate, B_up), alpha doubled so that alpha/rank is
unchanged (peft's own conversion of transformers-4 adapters does the same).

The dense and shared-expert MLPs are targeted as parameters too (`model.layers.0.mlp.gate_proj.weight`):
as `target_modules`, peft 0.21 rewrites any gate_proj / up_proj / down_proj target of these MoE
families into a target on the fused experts (its transformers-4 conversion), dropping the dense ones.
A ParamWrapper on a 2-D weight adds scaling * B @ A to it, as a LoRA Linear does, under the same
tensor names (`<module>.lora_A.weight`).

Two parameters of one module nest: peft wraps them in the module's parameter order, so the first
(gate_up_proj) ends up inside, its factors under `experts.base_layer.lora_A.weight`, and the outer
one (down_proj) under `experts.lora_A.weight`.
"""
from __future__ import annotations

import re

import torch

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)$")


def peft_tensors(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`full_adapters`' factors under PEFT's names (base_model.model.<module>.lora_A.weight, never
    Megatron's fused or `.base_layer` names): what the PEFT export writes and the adapter-only
    sync sends to vLLM."""
    state = {}
    for name, (a, b) in adapters.items():
        state[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        state[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    return state


def moe_layout(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], spec, rank: int, alpha: float) -> dict:
    """`full_adapters`' factors of a MoE model in PEFT's transformers-5 layout: {"tensors": PEFT
    state dict, "target_modules", "target_parameters", "rank_pattern", "alpha_pattern"}."""
    names = spec.hf_names
    modules, parameters, plain = [], [], {}
    experts: dict[int, dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = {}
    for name, pair in adapters.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(int(m.group(1)), {}).setdefault(int(m.group(2)), {})[m.group(3)] = pair
            continue
        plain[name] = pair
        if ".self_attn." not in name:  # a dense or shared-expert MLP
            parameters.append(f"{name}.weight")
        else:
            modules.append(name)
    tensors = peft_tensors(plain)
    rank_pattern, alpha_pattern = {}, {}
    for layer, per_expert in sorted(experts.items()):
        if sorted(per_expert) != list(range(spec.num_experts)):
            raise ValueError(f"layer {layer}: adapters on experts {sorted(per_expert)}, not on all {spec.num_experts}")
        container = f"model.layers.{layer}.mlp.experts"  # transformers 5 names every family's MoE block `mlp`
        fused = []  # (parameter, A per expert, B per expert, rank) in the module's parameter order
        gate_up = [p for p in (names.expert_gate, names.expert_up) if p in per_expert[0]]
        if gate_up:
            a = [torch.cat([per_expert[e][p][0] for p in gate_up], 0) for e in range(spec.num_experts)]
            b = [_gate_up_b([per_expert[e].get(p, (None, None))[1] for p in (names.expert_gate, names.expert_up)])
                 for e in range(spec.num_experts)]
            fused.append(("gate_up_proj", a, b, rank * len(gate_up)))
        if names.expert_down in per_expert[0]:
            pairs = [per_expert[e][names.expert_down] for e in range(spec.num_experts)]
            fused.append(("down_proj", [p[0] for p in pairs], [p[1] for p in pairs], rank))
        for depth, (param, a, b, r) in enumerate(fused):
            key = f"base_model.model.{container}" + ".base_layer" * (len(fused) - 1 - depth)
            tensors[f"{key}.lora_A.weight"] = torch.cat(a, 0).contiguous()  # [E*r, in]
            tensors[f"{key}.lora_B.weight"] = torch.stack(b, -1).reshape(b[0].shape[0], -1).contiguous()  # [out, r*E]
            parameters.append(f"{container}.{param}")
            if r != rank:
                rank_pattern[re.escape(f"{container}.{param}")] = r
                alpha_pattern[re.escape(f"{container}.{param}")] = alpha * r / rank
    return {"tensors": tensors, "target_modules": sorted(modules), "target_parameters": sorted(parameters),
            "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern}


def _gate_up_b(bs: list[torch.Tensor | None]) -> torch.Tensor:
    """B of the fused [gate; up] rows: blockdiag of the present projections' B, zero rows for an
    absent one (its f rows get no update)."""
    present = [b for b in bs if b is not None]
    f, r = present[0].shape
    rows = []
    col = 0
    for b in bs:
        block = torch.zeros(f, r * len(present), dtype=present[0].dtype)
        if b is not None:
            block[:, col:col + r] = b
            col += r
        rows.append(block)
    return torch.cat(rows, 0)
