"""No collective over a group of one.

At world size 1 (and for every group of one rank at larger sizes: the data-parallel group at dp 1,
the model-parallel group at tp 1 pp 1) Megatron-Core still issues its collectives: the DDP gradient
reduce-scatter, the distributed optimizer's parameter all-gather, the gradient norm's all-reduce.
Over one rank each is the identity, yet on gloo each costs a call into the backend and a wait (about
2 ms per optimizer step of the CPU demo, 4% of it). `install()` makes those calls return at once
when their group has one rank:

- `torch.distributed.all_reduce` (synchronous calls only): the reduction of one tensor is itself.
- Megatron's bucket all-gather and reduce-scatter (`param_and_grad_buffer.dist_all_gather_func`,
  `dist_reduce_scatter_func`): with one rank the shard is the whole buffer, the very same memory;
  were it not, the input is copied to the output, which is what the collective would do.

Inside a coalescing block nothing is queued, so the block issues nothing either. Asynchronous calls
(they return a handle to wait on) and groups of two or more are passed through unchanged.

Replacing `torch.distributed.all_reduce` is process-group surgery: megarl.platform.process_groups
installs it (and says what it was checked on); this module only supplies the replacement.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.platform import process_groups

_INSTALLED = False
_BUCKET_ORIGINALS: dict = {}  # Megatron's bucket collectives that install() replaced, by name


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def _solo_all_reduce(original):
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not async_op and _group_size(group) == 1:
            return None
        return original(tensor, op=op, group=group, async_op=async_op)

    all_reduce.__wrapped__ = original
    return all_reduce


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


def _solo_bucket_collective(original):
    def collective(output, input, *args, group=None, async_op=False, **kwargs):
        if not async_op and _group_size(group) == 1:
            if not _same_memory(output, input):
                output.copy_(input.view_as(output))
            return None
        return original(output, input, *args, group=group, async_op=async_op, **kwargs)

    collective.__wrapped__ = original
    return collective


def install() -> None:
    """Once per process, before Megatron's DDP and optimizer are used."""
    global _INSTALLED
    if _INSTALLED:
        return
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.distributed import param_and_grad_buffer as buffers

    process_groups.install_all_reduce(_solo_all_reduce)
    for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):
        if hasattr(buffers, name):
            _BUCKET_ORIGINALS[name] = getattr(buffers, name)
            setattr(buffers, name, _solo_bucket_collective(getattr(buffers, name)))
    _INSTALLED = True


def uninstall() -> None:
    """Undo `install()`: torch's all-reduce and Megatron's bucket collectives as they were."""
    global _INSTALLED
    if not _INSTALLED:
        return
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.distributed import param_and_grad_buffer as buffers

    process_groups.uninstall_all_reduce()
    for name, original in _BUCKET_ORIGINALS.items():
        setattr(buffers, name, original)
    _BUCKET_ORIGINALS.clear()
    _INSTALLED = False
