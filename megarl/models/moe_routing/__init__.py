"""MoE routing for RL: the router's settings (fp32 logits, frozen weights, auxiliary loss) and
**routing replay**, in four rooms by what each owns:

- `options`: `RouterOptions`, the router part of the TransformerConfig, the option check, the
  transformers group-limited top-k rule, and the chunk's routers;
- `replay`: the actor's replay hook on Megatron's `TopKRouter` and each micro-batch's routes;
- `hf_recorder`: `HFRouteRecorder`, the experts a transformers model routes each token to;
- `aux_loss`: the auxiliary load-balancing loss as a metric (`aux_loss_metric`).

`prepare` (here, since it installs what the rooms own) applies a `RouterOptions` to a freshly built
model chunk. Callers may import the names below from this package; docs/moe_routing.md explains
the design.
"""
from __future__ import annotations

import torch

from megarl.models.moe_routing.aux_loss import aux_loss_metric, install_meter
from megarl.models.moe_routing.hf_recorder import HFRouteRecorder, hf_routers
from megarl.models.moe_routing.options import (LoadBalancingType, RouterOptions, check_routing_options,
                                               hf_group_limited_topk, router_config, routers, unwrap_config,
                                               use_hf_group_limited_topk)
from megarl.models.moe_routing.replay import (ROUTES, attach_routes, has_replay, install_replay, micro_batch_routes,
                                              replaying, sequence_parallel_shard)


def prepare(model: torch.nn.Module, options: RouterOptions | None) -> None:
    """Apply `options` to a freshly built model chunk (before DDP wraps it): freeze the routers,
    install routing replay, count auxiliary-loss forwards."""
    if options is None:
        return
    found = routers(model)
    if options.freeze:
        for router in found:
            for p in router.parameters(recurse=False):  # weight (and bias); expert_bias is a buffer
                p.requires_grad_(False)
    if options.replay:
        install_replay(model, found)
    if options.aux_loss_on:
        install_meter(model, found)


__all__ = ["RouterOptions", "router_config", "prepare", "replaying", "has_replay", "attach_routes",
           "micro_batch_routes", "sequence_parallel_shard", "use_hf_group_limited_topk", "HFRouteRecorder", "hf_routers",
           "aux_loss_metric", "ROUTES", "LoadBalancingType", "check_routing_options", "hf_group_limited_topk", "routers",
           "unwrap_config"]
