"""Recording routes on the transformers side (megarl.models.moe_routing): `HFRouteRecorder` hooks
a transformers MoE model's routers and turns its forward calls into the per-token routes
`[tokens, num_layers, topk]` that routing replay (`replay.py`) hands the actor.
"""
from __future__ import annotations

import re

import torch

_HF_LAYER = re.compile(r"\blayers\.(\d+)\.")


def hf_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router) of a transformers MoE model. Every MoE family in transformers 5
    (Qwen3MoeTopKRouter, MixtralTopKRouter, DeepseekV3TopkRouter, Glm4MoeTopkRouter) returns
    (logits, weights, top-k indices) from a module whose class name ends in TopKRouter."""
    found = []
    for name, module in model.named_modules():
        m = _HF_LAYER.search(name)
        if m and type(module).__name__.lower().endswith("topkrouter"):
            found.append((int(m.group(1)), module))
    return found


class HFRouteRecorder:
    """Records the experts a transformers model routes each token to, one forward call at a time.

    `calls[c][layer]` holds call c's indices [batch * seq, topk] (transformers flattens [b, s]
    b-major). Used as a context manager around one batched decode.
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = hf_routers(model)
        if not self.routers:
            raise ValueError(f"routing replay: {type(model).__name__} has no MoE router to record (a dense model?)")
        self.num_layers = int(model.config.num_hidden_layers)
        self.calls: list[dict[int, torch.Tensor]] = []
        self._handles = []

    def __enter__(self):
        self.calls = []
        for layer, module in self.routers:
            self._handles.append(module.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, layer: int):
        def hook(module, args, output):
            if layer == self.routers[0][0]:  # the first MoE layer opens a new forward call
                self.calls.append({})
            self.calls[-1][layer] = output[2].detach().to("cpu", torch.int16)
        return hook

    def routes(self, row: int, batch: int, prompt_len: int, padded_prompt_len: int, fed_responses: int) -> torch.Tensor:
        """[prompt_len + fed_responses, num_layers, topk] of one row of a left-padded batch: call 0
        is the prompt forward ([batch, padded_prompt_len]), each later call one decoded token."""
        topk = next(iter(self.calls[0].values())).shape[-1]
        out = torch.full((prompt_len + fed_responses, self.num_layers, topk), -1, dtype=torch.int16)
        for layer, idx in self.calls[0].items():
            out[:prompt_len, layer] = idx.view(batch, padded_prompt_len, topk)[row, padded_prompt_len - prompt_len:]
        for j in range(fed_responses):
            for layer, idx in self.calls[1 + j].items():
                out[prompt_len + j, layer] = idx.view(batch, topk)[row]
        return out
