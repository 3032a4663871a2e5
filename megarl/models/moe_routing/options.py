"""The MoE router's settings for RL (megarl.models.moe_routing): `RouterOptions` (fp32 logits,
frozen weights, auxiliary loss, replay on or off), the router part of a MoE model's
TransformerConfig, the check that refuses MoE-only options on a dense model, the group-limited
top-k rule of transformers, and where the routers and megarl's per-chunk objects sit in a model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LoadBalancingType = Literal["aux_loss", "seq_aux_loss", "global_aux_loss"]


@dataclass(frozen=True)
class RouterOptions:
    """How one engine's MoE routers train.

    freeze: router weights get requires_grad=False, so DDP and the optimizer leave them out.
    aux_loss_coeff: the auxiliary load-balancing loss (0 = off, the RL default: it is a
        pre-training device, and it makes the loss depend on how tokens are split over ranks).
    load_balancing_type: Megatron's kind of auxiliary loss when the coefficient is > 0.
    replay: install routing replay on this engine's routers (the actor's).
    """

    freeze: bool = False
    aux_loss_coeff: float = 0.0
    load_balancing_type: LoadBalancingType = "aux_loss"
    replay: bool = False

    @property
    def aux_loss_on(self) -> bool:
        return self.aux_loss_coeff > 0


def router_config(options: RouterOptions | None) -> dict:
    """The router part of a MoE model's TransformerConfig.

    Router logits are computed in fp32 in every dtype: Megatron's gating linear upcasts the input
    and the (params_dtype) weight to `moe_router_dtype` before the matmul, and softmax / sigmoid and
    top-k then run in fp32. In float32 this changes nothing; in bf16 it keeps near-tied experts
    from swapping on rounding alone (transformers computes bf16 logits there, which is one reason
    routes can differ between an hf rollout and the actor, and why replay exists).
    """
    options = options or RouterOptions()
    return dict(
        moe_router_dtype="fp32",
        moe_router_load_balancing_type=options.load_balancing_type if options.aux_loss_on else "none",
        moe_aux_loss_coeff=options.aux_loss_coeff,
    )


def routers(model: torch.nn.Module) -> list:
    """Megatron's TopKRouter modules in `model` (any wrapper), in module order."""
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def attached(model: torch.nn.Module, name: str):
    """The object megarl attached to `model` under `name` (install_replay, install_meter), looked up
    through wrappers (DDP, Float16Module); None when absent."""
    while True:
        found = getattr(model, name, None)
        if found is not None or not hasattr(model, "module"):
            return found
        model = model.module


def unwrap_config(model: torch.nn.Module):
    """The TransformerConfig of a model chunk under its wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model.config


def check_routing_options(options: RouterOptions, is_moe: bool, family: str) -> None:
    """A dense model with MoE-only options is a config mistake, said once."""
    if is_moe:
        return
    for key, on in (("actor.routing_replay", options.replay), ("actor.moe_aux_loss_coeff", options.aux_loss_on)):
        if on:
            raise ValueError(f"{key} applies to mixture-of-experts models; model.path is a dense {family} model: "
                             f"turn it off")


# --- transformers' group-limited top-k ----------------------------------------------------------


def hf_group_limited_topk(scores: torch.Tensor, topk: int, num_tokens: int, num_experts: int, num_groups: int,
                          group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k as DeepSeek-V3 and GLM-4.5 define it in transformers: a group's score is
    the sum of its two best experts' scores. Megatron-Core sums the best
    `topk // group_topk` instead, which is the same only when that is 2 (DeepSeek-V3's 8 / 4);
    a checkpoint with, say, 4 experts from 1 of 2 groups would route differently."""
    grouped = scores.view(num_tokens, num_groups, -1)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups).reshape(num_tokens, -1)
    masked = scores.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(masked, k=topk, dim=-1)


def use_hf_group_limited_topk() -> None:
    """Make Megatron-Core's routers rank expert groups as transformers does (`hf_group_limited_topk`).

    Process-wide: `topk_routing_with_score_function` looks `group_limited_topk` up in its module at
    every call (0.16 to 0.19), so replacing it there reaches every router, replayed ones included
    (replay falls back to it for unrecorded tokens). megarl only builds models from Hugging Face
    checkpoints, whose routing transformers defines, so no router of the process wants the other rule."""
    from megatron.core.transformer.moe import moe_utils  # deferred: megatron (seconds to import) loads only when this runs

    moe_utils.group_limited_topk = hf_group_limited_topk
