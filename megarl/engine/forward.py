"""Forward passes through Megatron's pipeline schedules, with per-token outputs on every stage.

Micro-batches are dicts of `[micro_batch, seq]` tensors (`megarl.engine.micro_batches`: padded rows,
or one packed row with `packed_seq_params`); every micro-batch of one call has the same shape,
because pipeline stages exchange fixed-shape activations.

With virtual pipeline stages (`dims.vpp`) a rank holds one model chunk per virtual stage and
Megatron's interleaved 1F1B schedule runs them; it takes one data iterator per chunk (each chunk's
forward step draws the micro-batch it works on) and needs a micro-batch count that is a multiple
of pp (`interleaved_count`).
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from megarl.models.moe_routing import ROUTES, replaying
from megarl.distributed.parallel import ParallelDims, broadcast_host
from megarl.platform.cpu_compat import device_rewrite_paused

# compute(output, micro_batch) -> {name: tensor [micro_batch, ...]}; output is the last stage's
# model output: vocab-parallel logits [b, s, vocab/tp] (or values [b, s, 1] for a critic).
ComputeFn = Callable[[torch.Tensor, dict], dict[str, torch.Tensor]]


def model_forward(model: torch.nn.Module, micro_batch: dict) -> torch.Tensor:
    """One micro-batch through this stage (earlier stages' activations arrive via the schedule)."""
    ids = micro_batch["input_ids"]
    positions = micro_batch.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
    # MoE routing replay: the routers use the rollout's experts for these tokens (megarl.models.moe_routing)
    with replaying(model, micro_batch.get(ROUTES)), device_rewrite_paused(is_dense(model)):
        return model(input_ids=ids, position_ids=positions, attention_mask=None,
                     packed_seq_params=micro_batch.get("packed_seq_params"))


def is_dense(model) -> bool:
    """A dense (no MoE), non-MLA model: its layers never name CUDA, so on CPU its forward and backward
    may run without the device-rewrite mode (megarl.platform.cpu_compat.device_rewrite_paused).
    MoE layers (aux-loss tracker) and MLA are left under the mode."""
    config = model[0].config if isinstance(model, (list, tuple)) else model.config
    return getattr(config, "num_moe_experts", None) is None and not getattr(config, "multi_latent_attention", False)


def interleaved_count(count: int, dims: ParallelDims) -> int:
    """Micro-batches to run for `count` real ones: Megatron's interleaved schedule runs micro-batches
    in groups of pp per virtual stage and refuses a count that is not a multiple of pp (it would
    stall the pipeline), so the rest is made up with filler micro-batches that carry no rows."""
    if not dims.vpp:
        return count
    return -(-count // dims.pp) * dims.pp


def schedule_inputs(model, micro_batches: list[dict], dims: ParallelDims) -> tuple[list, object]:
    """(model chunks, data iterator(s)) as Megatron's schedules take them: with virtual stages one
    iterator per chunk, each yielding every micro-batch in order."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if dims.vpp:
        return chunks, [iter(micro_batches) for _ in chunks]
    return chunks, iter(micro_batches)


@torch.no_grad()
def pipeline_forward(model, dims: ParallelDims, micro_batches: list[dict], compute: ComputeFn) -> list[dict[str, torch.Tensor]]:
    """Forward-only over all micro-batches; returns compute()'s outputs on *every* pipeline stage.
    `model` is this rank's model or its list of chunks (virtual pipeline stages)."""
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        return []
    count = len(micro_batches)
    # Forward only: a filler is a repeat of the last micro-batch, whose results are dropped.
    micro_batches = micro_batches + [micro_batches[-1]] * (interleaved_count(count, dims) - count)
    batch, seq = micro_batches[0]["input_ids"].shape
    for mb in micro_batches:
        if mb["input_ids"].shape != (batch, seq):
            raise ValueError("all micro-batches of one pipeline call must have the same [batch, seq] shape")

    def loss_func(mb, output, non_loss_data=True):
        return compute(output, mb)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return model_forward(model, mb), partial(loss_func, mb)

    chunks, data_iterator = schedule_inputs(model, micro_batches, dims)
    store = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=chunks,
        num_microbatches=len(micro_batches),
        seq_length=seq,
        micro_batch_size=batch,
        forward_only=True,
        collect_non_loss_data=True,
    )
    return broadcast_from_last_stage(store[:count], dims, count)


def broadcast_from_last_stage(store: list[dict], dims: ParallelDims, count: int) -> list[dict[str, torch.Tensor]]:
    """Move the last stage's per-micro-batch results to every stage of the pipeline group."""
    if dims.pp == 1:
        return store
    stage_ranks = dims.pp_stage_ranks()
    src = stage_ranks[-1]
    # Shapes and dtypes first (small objects), then the tensors themselves.
    header = [[(k, tuple(v.shape), v.dtype) for k, v in d.items()] for d in store] if dims.is_last_stage else None
    box = [header]
    dist.broadcast_object_list(box, src=src, group=dims.pp_group)
    header = box[0]
    out = []
    for i in range(count):
        entry = {}
        for key, shape, dtype in header[i]:
            t = store[i][key] if dims.is_last_stage else torch.empty(shape, dtype=dtype)
            entry[key] = broadcast_host(t, src, dims.pp_group)
        out.append(entry)
    return out
