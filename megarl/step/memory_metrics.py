"""The step's memory metrics, from the engines that report their own state: bytes offloaded and
onloaded (`bytes_moved`), the parameters, gradients and optimizer state resident per phase
(`resident_bytes`, reduced by `resident_metrics` with each trained engine's state by size), and
the process's own (`process_memory_metrics`: CPU RSS, the CUDA allocator's peak)."""
from __future__ import annotations

from typing import Sequence

import psutil
import torch
import torch.distributed as dist

from megarl.distributed.parallel import all_reduce_host
from megarl.engine.engine import MegatronEngine

# MegatronEngine.state_bytes parts -> metric names
STATE_NAMES = {"params": "param", "trainable_params": "trainable_param", "grads": "grad", "optimizer": "optimizer_state"}


def bytes_moved(engines: Sequence[MegatronEngine]) -> dict[str, int]:
    """Bytes offloaded and onloaded so far by this rank's engines."""
    return {kind: sum(e.bytes_moved[kind] for e in engines) for kind in ("offload", "onload")}


def resident_bytes(engines: Sequence[MegatronEngine]) -> int:
    """The engines' state in memory now, in bytes."""
    return sum(sum(e.resident_bytes().values()) for e in engines)


def resident_metrics(resident: dict[str, int], trained: dict[str, MegatronEngine | None], delta_copy_bytes: int,
                     world_size: int) -> dict[str, float]:
    """memory/resident_gb/<phase>: the engines' parameters, gradients and optimizer state in
    memory at the end of each phase (`resident`, by timing_s/<phase>); memory/<role>/{param,
    trainable_param,grad,optimizer_state}_bytes: each trained engine's state by size (`trained`, by
    role; under LoRA the last three follow the adapters); memory/weight_sync_copy_bytes: what
    rollout.weight_sync.mode=delta keeps between syncs (0 under full). All the maximum over ranks,
    in one collective per step."""
    names = {f"memory/resident_gb/{p.removeprefix('timing_s/')}": resident[p] / 2**30 for p in resident}
    names["memory/weight_sync_copy_bytes"] = float(delta_copy_bytes)
    for role, engine in trained.items():
        if engine is not None:
            sizes = engine.state_bytes()
            names.update({f"memory/{role}/{STATE_NAMES[part]}_bytes": float(sizes[part]) for part in STATE_NAMES})
    values = torch.tensor(list(names.values()), dtype=torch.float64)
    if world_size > 1:
        values = all_reduce_host(values, None, op=dist.ReduceOp.MAX)
    return {name: float(v) for name, v in zip(names, values)}


def process_memory_metrics() -> dict[str, float]:
    """perf/cpu_rss_gb of this process; perf/max_memory_allocated_gb with CUDA."""
    out = {"perf/cpu_rss_gb": psutil.Process().memory_info().rss / 2**30}
    if torch.cuda.is_available():
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out
