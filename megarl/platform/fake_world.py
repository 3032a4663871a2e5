"""A world of any size in one CPU process, for the dry run (megarl.tools.dryrun): torch's fake
communication backend, Megatron's gloo groups on it, and allocations on the meta device.

Checked on torch 2.13 and Megatron-Core 0.16.1 (tests/tools/test_dryrun.py breaks when an upgrade
breaks it):
- `dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=N)` gives rank r of a
  world of N: `new_group` and every collective return at once, tensors unchanged. torchtitan's
  estimator (scripts/estimate/estimation.py) does the same. One world at a time: `enter` destroys
  the previous one, so one process can be each rank of the world in turn.
- Megatron's `initialize_model_parallel` also builds gloo copies of its data-parallel groups (the
  distributed optimizer asks for them); a gloo group cannot be made on a FakeStore ("Not
  implemented"), so `gloo_groups_on_fake` makes those groups on the fake backend too.
- DDP's buffers and the distributed optimizer allocate with explicit devices
  (`torch.cuda.current_device()`, `device='cuda'`); `MetaAllocation` sends every such allocation to
  the meta device, so a 671B model's buffers cost shapes, not memory. The distributed optimizer's
  checkpoint state (megarl.engine.checkpointing) copies through the host (`.cpu()`, `.cuda()`): a
  meta tensor stays itself there.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.testing._internal.distributed.fake_pg import FakeStore

FAKE_BACKEND = "fake"


def enter(rank: int, world_size: int) -> None:
    """Make this process rank `rank` of a fake world of `world_size` (the previous world is left)."""
    leave()
    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world_size)


def leave() -> None:
    """Destroy Megatron's groups and the default process group, if any."""
    from megatron.core import parallel_state  # deferred: megatron (seconds to import) loads only when this runs

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_fake() -> bool:
    """Whether the default process group is the fake backend's."""
    return dist.is_initialized() and dist.get_backend() == FAKE_BACKEND


@contextlib.contextmanager
def gloo_groups_on_fake():
    """While Megatron builds its groups in a fake world, its gloo groups are fake ones as well."""
    if not is_fake():
        yield
        return
    real_new_group = dist.new_group

    def new_group(*args, **kwargs):
        if kwargs.get("backend") == "gloo":
            kwargs = dict(kwargs, backend=None)
        return real_new_group(*args, **kwargs)

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = real_new_group


class MetaAllocation(TorchFunctionMode):
    """Every allocation that names a device (and every `.to(device)`) lands on the meta device.

    Object collectives pickle into tensors and read sizes back (`.item()`), which the meta device
    cannot: inside this mode `all_gather_object` gives every rank this rank's object (Megatron
    gathers its parameter-group keys to check that every rank has the same ones)."""

    def __enter__(self):
        self._real_all_gather_object = dist.all_gather_object

        def all_gather_object(object_list, obj, group=None):
            object_list[:] = [obj] * len(object_list)

        dist.all_gather_object = all_gather_object
        return super().__enter__()

    def __exit__(self, *exc):
        dist.all_gather_object = self._real_all_gather_object
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("device") is not None:
            kwargs = dict(kwargs, device="meta")
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], torch.dtype):
            args = (args[0], "meta", *args[2:])
        if func in (torch.Tensor.cpu, torch.Tensor.cuda) and args[0].is_meta:
            return args[0]  # the optimizer's checkpoint state gathers through host copies (`.cpu()`)
        return func(*args, **kwargs)
