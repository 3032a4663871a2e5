"""Megatron distributed checkpoints of one engine: weights, optimizer, LR scheduler, RNG states
(under LoRA the adapters instead of the weights, with a reference to the base: adapter_checkpoint.py).

Saved as `ShardedTensor`s with global offsets, so a checkpoint written under one TP/PP/DP layout
loads under any other. Atomicity (temporary directory, rename, COMPLETE marker) is the caller's:
`megarl.checkpointing.checkpoint` wraps every engine save of a run. Two Megatron-Core 0.16 gaps are covered
here, each explained where it is handled.
"""
from __future__ import annotations

import os
import random
import time
from contextlib import contextmanager
import io
import pickle
import queue

import numpy as np
import torch
import torch.distributed as dist

from megarl.platform.safe_load import UnsafeCheckpointError, check_dcp_metadata, load_plain
from megarl.engine import adapter_checkpoint
from megarl.platform import mcore_version, process_groups

# The distributed optimizer's one format that reshards across TP, PP *and* DP in Megatron-Core 0.16
# (its "fully_sharded_model_space" default uses flattened ranges, which dist_checkpointing now
# refuses). It gathers each DP group's optimizer state on the group's first rank while saving.
OPTIM_CKPT_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}
EXTRA_STATE_FILE = "engine_extra.pt"
RNG_DIR = "rng"


def _optimizers(engine) -> list:
    return list(getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]))


def ensure_optimizer_state(engine) -> None:
    """Adam creates its state lazily at the first step, but Megatron's checkpoint code reads it
    (including `step`) when saving before any update and when loading into a fresh engine."""
    for opt in _optimizers(engine):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if len(inner.state[p]) == 0:
                    inner.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    inner.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
                    inner.state[p]["step"] = torch.tensor(0.0)


def _model_keys(engine) -> list[str]:
    # "model" for the first chunk (a checkpoint of one chunk per rank keeps its old layout), "model1",
    # ... for the virtual pipeline stages after it (Megatron-LM's naming). Only the dict keys differ:
    # every chunk's tensors carry global layer numbers under the prefix "model.", which is what a
    # load under another layout (vpp or not) matches on.
    return ["model"] + [f"model{i}" for i in range(1, len(engine.modules))]


def _refuse_tied_virtual_stages(engine) -> None:
    """Megatron-Core 0.16's optimizer checkpoint (fully_reshardable) restores the parameter state of
    the later model chunks wrongly when the embeddings are tied and a rank holds several chunks
    (found by tests/layouts: the weights load right, Adam's state and main params do not). Refused
    rather than resumed wrong."""
    if engine.trainable and len(engine.modules) > 1 and engine.spec.tie_embeddings:
        raise ValueError("checkpoints of a model with tied embeddings under virtual pipeline stages (parallel.vpp) are "
                         "not restored correctly by Megatron-Core's optimizer checkpoint; use parallel.vpp=null for "
                         "this model")


def model_sharded_state_dict(engine) -> dict:
    """The model part of the checkpoint's sharded state dict, by chunk key (the dry run lists it too)."""
    _refuse_tied_virtual_stages(engine)
    engine.onload()
    state = {key: m.sharded_state_dict(prefix="model.") for key, m in zip(_model_keys(engine), engine.modules)}
    if engine.lora is not None:  # adapters only: the frozen base is rebuilt from its directory (adapter_checkpoint)
        state = {key: adapter_checkpoint.adapter_state(engine, s) for key, s in state.items()}
    return state


def _sharded_state_dict(engine, is_loading: bool) -> dict:
    state = model_sharded_state_dict(engine)
    if engine.trainable:
        ensure_optimizer_state(engine)
        model_sd = dict(state)  # the optimizer finds each parameter's sharded tensor in any chunk
        state["optimizer"] = engine.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIM_CKPT_FORMAT)
    return state


def save_engine(engine, path: str) -> float:
    """Collective: every rank writes its shards into `path` (a directory all ranks see)."""
    from megatron.core import dist_checkpointing  # deferred: megatron (seconds to import) loads only when this runs

    start = time.perf_counter()
    os.makedirs(path, exist_ok=True)
    _results_queue_without_a_server()
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(engine, is_loading=False), path)
    if engine.dims.rank == 0:
        torch.save(engine.extra_state(), os.path.join(path, EXTRA_STATE_FILE))
        if engine.lora is not None:
            adapter_checkpoint.write_base_ref(engine, path)
        mcore_version.record_checkpoint_version(path)
        os.makedirs(os.path.join(path, RNG_DIR), exist_ok=True)
    dist.barrier()
    torch.save(rng_state(engine.dims), _rng_file(path, engine.dims.rank))
    dist.barrier()
    return time.perf_counter() - start


class CheckpointMismatch(ValueError):
    """A checkpoint whose tensors do not match the model being loaded (another architecture or size)."""


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.strip().startswith("Traceback")]
    text = next((ln for ln in lines if "size" in ln.lower() or "shape" in ln.lower() or "mismatch" in ln.lower()),
                lines[0] if lines else type(e).__name__)
    return " ".join(text.split())[:300]


def _results_queue_without_a_server() -> None:
    """Keep Megatron's checkpoint writer from starting processes that outlive a killed run.

    Megatron-Core 0.16's FileSystemWriterAsync collects write results through
    `multiprocessing.get_context("spawn").Manager().Queue()`: a spawned manager server (a whole
    Python with torch, ~300 MB) plus multiprocessing's resource tracker, both left running for good
    when the trainer is killed with SIGKILL. megarl saves synchronously, so the results never
    leave this process (its forked writers report on their own local queue, and the writer puts the
    merged result here and reads it back in this same process): a plain in-process queue (no
    server, no tracker) carries them. Set once, before the first save would create the manager.
    """
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def load_engine(engine, path: str) -> None:
    """Collective: fill the engine (any layout) from a checkpoint written by `save_engine`."""
    from megatron.core import dist_checkpointing  # deferred: megatron (seconds to import) loads only when this runs
    # deferred: torch.distributed.checkpoint (a second to import: sympy) loads only when this runs
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    mcore_version.require_readable_checkpoint(path)
    metadata = os.path.join(path, ".metadata")
    if os.path.exists(metadata):
        check_dcp_metadata(metadata)
    with _plain_bytes_only(path):
        try:
            loaded = dist_checkpointing.load(_sharded_state_dict(engine, is_loading=True), path)
        except UnsafeCheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # Megatron reports a mismatch deep inside DCP, as a long traceback
            written_ep = _written_ep(path)
            if written_ep is not None and (written_ep > 1) != (engine.dims.ep > 1):
                # Megatron's distributed optimizer keeps expert parameters in their own buckets
                # only at ep > 1: the optimizer state has another structure on each side
                raise CheckpointMismatch(
                    f"checkpoint {path} was written at parallel.ep={written_ep} and this run has parallel.ep={engine.dims.ep}: "
                    f"the optimizer state of expert parameters does not cross between ep = 1 and ep > 1; resume at "
                    f"parallel.ep{'=1' if written_ep == 1 else ' > 1'} (other TP/PP/DP/CP layouts work)") from e
            raise CheckpointMismatch(
                f"checkpoint {path} does not fit this model ({_first_line(e)}); it was written for another "
                f"architecture or size: resume with the model.path it was trained from, or use another trainer.run_dir") from e
    rng_file = _rng_file(path, engine.dims.rank)
    if os.path.exists(rng_file):
        restore_rng_state(load_plain(rng_file), engine.dims)
    for key, module in zip(_model_keys(engine), engine.modules):
        module.load_state_dict({k[len("model."):]: v for k, v in loaded[key].items()}, strict=False)
    if not engine.trainable:
        return
    optimizers = _optimizers(engine)
    states = [loaded["optimizer"]] if len(optimizers) == 1 else [loaded["optimizer"][i] for i in range(len(optimizers))]
    for opt, state in zip(optimizers, states):
        _load_distributed_optimizer(opt, state)
    extra = os.path.join(path, EXTRA_STATE_FILE)
    if os.path.exists(extra):
        engine.load_extra_state(load_plain(extra))


@contextmanager
def _plain_bytes_only(path: str):
    """torch.distributed.checkpoint unpickles the non-tensor items of a checkpoint ("bytes": e.g.
    the optimizer's param groups) with torch.load(weights_only=False), so a planted payload would
    run. While Megatron loads, that loader is replaced by one with weights_only=True (the
    replacement itself: megarl.platform.process_groups.dcp_load_bytes)."""
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"refusing to load {path}: item {read_item.dest_index.fqn} holds objects other than tensors and plain "
                f"data ({str(e).strip().splitlines()[0]}); loading it could run code: use a checkpoint you trust") from None
        if self.flatten_state_dict:
            process_groups.dcp_set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

    with process_groups.dcp_load_bytes(load_bytes):
        yield


def _load_distributed_optimizer(opt, state: dict) -> None:
    """DistributedOptimizer.load_state_dict, working around a Megatron-Core 0.16 gap.

    Without Apex/TE, torch Adam keeps `step` in every parameter's state, but the fully_reshardable
    loader copies only (param, exp_avg, exp_avg_sq) into that state and fails on `step`. So: load
    the non-parameter state (which restores `step` from the checkpoint's param groups), set `step`
    aside while the parameter state is copied, then put it back -- one tensor per parameter: the
    loader hands every parameter the *same* step tensor, which torch Adam then increments once per
    parameter per step (found by the resume test: the second step after a resume diverged).
    """
    param_state = state.pop("param_state", None)
    sharding_type = state.pop("param_state_sharding_type", None)
    try:
        opt.load_state_dict(state)
    except KeyError as err:  # Megatron-Core 0.19 matches param groups by their lr / wd settings
        raise ValueError(
            f"the checkpoint's optimizer param groups do not match this run's (no group with settings {err}): "
            f"Megatron-Core cannot load an optimizer across a changed learning rate or weight decay; resume with "
            f"the checkpoint's optim settings, or start a new run from its exported weights") from None
    if param_state is None:
        return
    if sharding_type != "fully_reshardable":
        raise ValueError(f"checkpoint optimizer format {sharding_type!r} is not the one megarl writes (fully_reshardable)")
    inner = opt.optimizer
    steps = {id(p): s.pop("step") for p, s in inner.state.items() if "step" in s}
    opt.load_parameter_state_from_fully_reshardable(param_state)
    for p, s in inner.state.items():
        if id(p) in steps:
            s["step"] = steps[id(p)].clone()


# --- RNG states ------------------------------------------------------------------------------------
# One file per rank. They are restored only under the layout that wrote them: under another layout a
# rank's streams (e.g. the tensor-parallel RNG of TP rank 1) have no counterpart, so the fresh
# seeding stays (as Megatron-LM does with --no-load-rng). megarl's own randomness (sampling,
# shuffles) is seeded from (seed, step) and needs none of this to resume exactly.


def _layout(dims) -> tuple:
    return (dims.world_size, dims.tp, dims.pp, dims.cp, dims.ep)


def _written_ep(path: str) -> int | None:
    """The expert-parallel size of the run that wrote the checkpoint (from rank 0's RNG file), or None."""
    try:
        return int(load_plain(_rng_file(path, 0))["layout"][4])
    except Exception:  # an older checkpoint without the file: no claim about its layout
        return None


def _rng_file(path: str, rank: int) -> str:
    return os.path.join(path, RNG_DIR, f"rank_{rank:05d}.pt")


def rng_state(dims) -> dict:
    from megatron.core import tensor_parallel  # deferred: megatron (seconds to import) loads only when this runs

    state = {
        "layout": _layout(dims),
        "python": random.getstate(),
        # numpy's state holds an ndarray, which weights_only loading refuses: stored as a tensor
        "numpy": _numpy_state_as_plain(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "megatron": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _numpy_state_as_plain(state: tuple) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))


def _numpy_state_from_plain(state: tuple) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)


def restore_rng_state(state: dict, dims) -> bool:
    """Restore the states saved by `rng_state` if they come from this layout; returns whether it did."""
    from megatron.core import tensor_parallel  # deferred: megatron (seconds to import) loads only when this runs

    if state.get("layout") != _layout(dims):
        return False
    random.setstate(state["python"])
    np.random.set_state(_numpy_state_from_plain(state["numpy"]))
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    return True
