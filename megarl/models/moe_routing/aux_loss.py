"""The auxiliary load-balancing loss as a metric (megarl.models.moe_routing): a meter counts each
router's training forwards so that Megatron's aux-loss tracker sums become means over MoE layers,
forwards and data-parallel ranks (`aux_loss_metric`, reported as `actor/moe_aux_loss`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from megarl.distributed.parallel import all_reduce_host
from megarl.models.moe_routing.options import attached, unwrap_config

_METER = "_megarl_aux_loss_meter"


def install_meter(model: torch.nn.Module, found: list) -> None:
    """Count the training forwards of `found`, the routers of `model` (one freshly built model chunk)."""
    setattr(model, _METER, _AuxLossMeter(found))


class _AuxLossMeter:
    """Counts the training forwards of each router, so the tracker's sums become means."""

    def __init__(self, found: list):
        self.counts: dict[int, int] = {}
        for router in found:
            router.register_forward_hook(self._hook(router))

    def _hook(self, router):
        def hook(module, args, output):
            if module.training and torch.is_grad_enabled():
                layer = router.layer_number - 1
                self.counts[layer] = self.counts.get(layer, 0) + 1
        return hook


def aux_loss_metric(chunks: Sequence[torch.nn.Module], dims) -> float | None:
    """The auxiliary load-balancing loss (without its coefficient) averaged over MoE layers, training
    forwards and data-parallel ranks since the last call; None when the loss is off. `chunks`: this
    rank's model chunks (one per virtual pipeline stage). Collective over the pipeline and
    data-parallel groups. Reads and clears Megatron's aux-loss tracker."""
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    meters = [m for m in (attached(c, _METER) for c in chunks) if m is not None]
    if not meters:
        return None
    num_layers = unwrap_config(chunks[0]).num_layers
    sums = torch.zeros(num_layers, dtype=torch.float64)
    counts = torch.zeros(num_layers, dtype=torch.float64)
    for name, entry in get_moe_layer_wise_logging_tracker().items():
        if name.endswith("load_balancing_loss"):
            sums += entry["values"].detach().double().cpu()[:num_layers]
    for meter in meters:  # each chunk counts the forwards of its own layers
        for layer, n in meter.counts.items():
            counts[layer] += n
        meter.counts.clear()
    clear_aux_losses_tracker()
    both = torch.stack([sums, counts])
    if dims.pp > 1:
        both = all_reduce_host(both, dims.pp_group)
    if dims.dp > 1:
        both = all_reduce_host(both, dims.dp_group) / dims.dp
    sums, counts = both
    layers = counts > 0
    return float((sums[layers] / counts[layers]).mean()) if layers.any() else 0.0
