"""Move an engine's parameters, gradients and optimizer state to host memory between phases.

Each tensor is copied into a host buffer and its device storage is resized to zero (the memory is
returned to the allocator); onload restores the storage and copies back, bit-exact. With Megatron's
DDP the parameters and gradients live in a few contiguous buffers, so whole buffers move at once.
On a CPU-only machine the "device" is host memory too: the mechanics (and the tests) are the same,
only the memory saving is not.

Offload is on the path of every step, so each tensor keeps one host buffer for the whole run,
page-locked where the tensor is on CUDA (allocated once, `host_buffer`), and copies go straight
between it and the device, asynchronously: one copy per tensor each way, and one wait per offload
(`wait_for_copies`, before the device storage is released). Onload needs no wait: its copies are
queued on the stream that will read the tensors, and the host buffers outlive them.
"""
from __future__ import annotations

import torch

_HOST = "_megarl_host_buffer"


def host_buffer(t: torch.Tensor) -> torch.Tensor:
    """A host tensor to hold `t` while it is offloaded: page-locked for a CUDA tensor (an
    asynchronous copy needs it), allocated once per tensor and kept across steps."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)


def wait_for_copies(tensors: list[torch.Tensor]) -> None:
    """Wait for the queued device-to-host copies of `tensors` (their streams)."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


def offload_tensors(tensors: list[torch.Tensor]) -> int:
    """Copy every tensor into its host buffer, wait once, release the device storages; returns bytes."""
    _copy_to_host(tensors)
    wait_for_copies(tensors)  # the storages must not be freed under a copy still reading them
    return _release(tensors)


def _copy_to_host(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        host = getattr(t, _HOST, None)
        if host is None or host.shape != t.shape or host.dtype != t.dtype:
            host = host_buffer(t)
            setattr(t, _HOST, host)
        host.copy_(t.detach(), non_blocking=True)


def _release(tensors: list[torch.Tensor]) -> int:
    nbytes = 0
    for t in tensors:
        nbytes += t.untyped_storage().nbytes()
        t.untyped_storage().resize_(0)
    return nbytes


def onload_tensors(tensors: list[torch.Tensor]) -> int:
    """Restore every tensor's storage and queue the copy back from its host buffer; returns bytes."""
    nbytes = 0
    for t in tensors:
        host = getattr(t, _HOST)
        size = host.numel() * host.element_size()
        t.untyped_storage().resize_(size)
        with torch.no_grad():
            t.copy_(host, non_blocking=True)
        nbytes += size
    return nbytes


def _ddp_buffers(engine) -> list:
    # Megatron's DDP keeps its buffers in lists named `buffers` (shadowing nn.Module.buffers); a
    # frozen engine (the reference) has no DDP wrapper, and its `buffers` is the Module method.
    found = []
    for chunk in engine.chunks:  # one DDP per virtual pipeline stage
        for name in ("buffers", "expert_parallel_buffers"):
            value = getattr(chunk, name, None)
            if isinstance(value, list):
                found += value
    return found


def _param_tensors(engine) -> list[torch.Tensor]:
    buffers = _ddp_buffers(engine)
    # DDP buffers only the trainable parameters; the frozen ones (LoRA's base weights, frozen
    # routers, a reference engine's all) are Parameters of their own, which keep the host copy.
    held = [b.param_data for b in buffers if b.param_data is not None]
    return held + _frozen_params(engine)


def _frozen_params(engine) -> list[torch.Tensor]:
    seen, frozen = set(), []
    for m in engine.modules:
        for p in m.parameters():  # a tied embedding is one Parameter, listed once per module
            if not p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                frozen.append(p)
    return frozen


def grad_tensors(engine) -> list[torch.Tensor]:
    return [b.grad_data for b in _ddp_buffers(engine)]


def _optimizer_state_tensors(engine) -> list[torch.Tensor]:
    if engine.optimizer is None:  # a frozen (reference) engine
        return []
    optimizers = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    tensors = []
    for opt in optimizers:
        for state in opt.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        # bf16 training keeps fp32 master copies of this rank's shard.
        for group in getattr(opt, "shard_fp32_from_float16_groups", []) or []:
            tensors += [p.data for p in group]
    return tensors


PARTS = {"params": _param_tensors, "grads": grad_tensors, "optimizer": _optimizer_state_tensors}


def offload_parts(engine, parts: tuple[str, ...]) -> dict[str, int]:
    """Offload `parts` (keys of PARTS) of the engine with one wait for all; bytes per part."""
    groups = {part: PARTS[part](engine) for part in parts}
    every = [t for ts in groups.values() for t in ts]
    _copy_to_host(every)
    wait_for_copies(every)
    return {part: _release(ts) for part, ts in groups.items()}


def onload_parts(engine, parts: tuple[str, ...]) -> dict[str, int]:
    """Bring `parts` back (asynchronous copies, no wait); bytes per part."""
    return {part: onload_tensors(PARTS[part](engine)) for part in parts}


def resident_bytes(engine) -> dict[str, int]:
    """Bytes of the engine's parameters, gradients and optimizer state now held in (device) memory:
    0 for what is offloaded."""
    def held(tensors):
        return sum(t.untyped_storage().nbytes() for t in tensors)

    return {
        "params": held(_param_tensors(engine)),
        "grads": held(grad_tensors(engine)),
        "optimizer": held(_optimizer_state_tensors(engine)),
    }


def state_bytes(engine) -> dict[str, int]:
    """Bytes of the engine's training state on this rank by its size, offloaded or not: all
    parameters, the trainable ones, their gradient buffers, the optimizer state (Adam moments and
    float32 master copies). Under LoRA the last three scale with the adapters, not the model."""
    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    trainable = {id(p): p for m in engine.modules for p in m.parameters() if p.requires_grad}
    return {
        "params": size(_param_tensors(engine)),
        "trainable_params": size(trainable.values()),
        "grads": size(grad_tensors(engine)),
        "optimizer": size(_optimizer_state_tensors(engine)),
    }
