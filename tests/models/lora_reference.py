"""A plain PyTorch LoRA reference on the transformers model, and megarl's adapter gradients under
global HF names, shared by the one-process test (test_lora.py) and the layout worker.

The reference adds scale * B @ A to each targeted HF weight through `torch.func.functional_call`
(`W + s B A` applied to x is `x W^T + s x A^T B^T`, PEFT's forward): one definition for separate
linears and for transformers' fused 3-D expert tensors (`experts.gate_up_proj [E, 2f, h]`,
`experts.down_proj [E, h, f]`)."""
from __future__ import annotations

import re

import torch

_EXPERT = re.compile(r"^(model\.layers\.\d+\.[\w.]+?)\.experts\.(\d+)\.(\w+)$")


def random_adapters(names_shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module name -> (A [rank, in], B [out, rank]), B non-zero so that A gets a gradient."""
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(rank, i, generator=g) * 0.2, torch.randn(o, rank, generator=g) * 0.2)
            for n, (o, i) in sorted(names_shapes.items())}


def reference_grads(hf_dir: str, adapters: dict, scale: float, tokens: torch.Tensor, weights: torch.Tensor,
                    expert_names: tuple[str, str, str]) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Loss = sum(weights * log p(token t+1 | ..t)) of the HF model with the adapters; its gradients
    with respect to every A and B. expert_names: the family's (gate, up, down) projection names."""
    from transformers import AutoModelForCausalLM

    # eager experts: the grouped-mm kernel takes no float64
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float64, experts_implementation="eager")
    model.eval()
    params = dict(model.named_parameters())
    leaves = {n: (a.double().requires_grad_(True), b.double().requires_grad_(True)) for n, (a, b) in adapters.items()}
    gate, up, down = expert_names
    override: dict[str, torch.Tensor] = {}
    expert_deltas: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, (a, b) in leaves.items():
        delta = scale * b @ a
        m = _EXPERT.match(name)
        if m:
            expert_deltas.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = delta
            continue
        override[f"{name}.weight"] = params[f"{name}.weight"] + delta
    for block, per_expert in expert_deltas.items():
        gu, dn = params[f"{block}.experts.gate_up_proj"], params[f"{block}.experts.down_proj"]
        f = gu.shape[1] // 2
        zeros = lambda rows, cols: torch.zeros(rows, cols, dtype=torch.float64)  # noqa: E731
        gu_d = torch.stack([torch.cat([per_expert.get(e, {}).get(gate, zeros(f, gu.shape[2])),
                                       per_expert.get(e, {}).get(up, zeros(f, gu.shape[2]))], 0) for e in range(gu.shape[0])])
        dn_d = torch.stack([per_expert.get(e, {}).get(down, zeros(*dn.shape[1:])) for e in range(dn.shape[0])])
        override[f"{block}.experts.gate_up_proj"] = gu + gu_d
        override[f"{block}.experts.down_proj"] = dn + dn_d
    logits = torch.func.functional_call(model, override, (tokens,)).logits
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    loss = (logprobs * weights).sum()
    loss.backward()
    return loss.detach(), {n: (a.grad, b.grad) for n, (a, b) in leaves.items()}


def megarl_adapter_params(chunks, spec, dims) -> dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """HF module name -> (lora_A, lora_B) parameters of this rank (one process: the full tensors)."""
    from megarl.models import lora
    from megarl.models.weights import _layer_offset, global_name, model_chunks

    out = {}
    experts_per_rank = spec.num_experts // dims.ep if spec.is_moe else 0
    for chunk in model_chunks(chunks):
        offset = _layer_offset(chunk)
        for name, module in chunk.named_modules():
            if not isinstance(getattr(module, "lora", None), lora.LoraAdapter):
                continue
            glob = global_name(name + ".weight", offset, dims.ep_rank * experts_per_rank)[: -len(".weight")]
            for proj, part in module.lora.adapters.items():
                out[lora.hf_module_name(glob, proj, spec)] = (part.lora_A, part.lora_B)
    return out
