"""Move an engine's parameters, gradients and optimizer state to host memory between phases.

Each tensor is copied to a host tensor and its device storage is resized to zero (the memory is
returned to the allocator); onload restores the storage and copies back, bit-exact. With Megatron's
DDP the parameters and gradients live in a few contiguous buffers, so whole buffers move at once.
On a CPU-only machine the "device" is host memory too: the mechanics (and the tests) are the same,
only the memory saving is not.
"""
from __future__ import annotations

import torch

_HOST = "_megarl_host_copy"


def _offload_tensor(t: torch.Tensor) -> int:
    host = t.detach().to("cpu", copy=True)
    if torch.cuda.is_available() and t.is_cuda:
        host = host.pin_memory()
    setattr(t, _HOST, host)
    nbytes = t.untyped_storage().nbytes()
    t.untyped_storage().resize_(0)
    return nbytes


def _onload_tensor(t: torch.Tensor) -> int:
    host = getattr(t, _HOST)
    t.untyped_storage().resize_(host.numel() * host.element_size())
    with torch.no_grad():
        t.copy_(host, non_blocking=False)
    delattr(t, _HOST)
    return host.numel() * host.element_size()


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
    if buffers:
        return [b.param_data for b in buffers if b.param_data is not None]
    return [p for m in engine.modules for p in m.parameters()]  # the Parameters themselves: they keep the host copy


def offload_params(engine) -> int:
    return sum(_offload_tensor(t) for t in _param_tensors(engine))


def onload_params(engine) -> int:
    return sum(_onload_tensor(t) for t in _param_tensors(engine))


def offload_grads(engine) -> int:
    return sum(_offload_tensor(b.grad_data) for b in _ddp_buffers(engine))


def onload_grads(engine) -> int:
    return sum(_onload_tensor(b.grad_data) for b in _ddp_buffers(engine))


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


def offload_optimizer(engine) -> int:
    return sum(_offload_tensor(t) for t in _optimizer_state_tensors(engine))


def onload_optimizer(engine) -> int:
    return sum(_onload_tensor(t) for t in _optimizer_state_tensors(engine))


def resident_bytes(engine) -> dict[str, int]:
    """Bytes of the engine's parameters, gradients and optimizer state now held in (device) memory:
    0 for what is offloaded."""
    def held(tensors):
        return sum(t.untyped_storage().nbytes() for t in tensors)

    return {
        "params": held(_param_tensors(engine)),
        "grads": held(b.grad_data for b in _ddp_buffers(engine)),
        "optimizer": held(_optimizer_state_tensors(engine)),
    }
