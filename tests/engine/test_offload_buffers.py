"""Offload copies each tensor once each way into a host buffer kept across steps, with one wait per
offload (issue 22 item 7, audit F8: it copied to pageable memory, then again into fresh pinned
memory, every tensor, every phase). Allocation and waiting are hooks, so this runs on CPU."""
from __future__ import annotations

import torch

import megarl.engine.offload as offload
from megarl.engine.engine import EngineConfig, MegatronEngine


def counted(monkeypatch) -> dict[str, int]:
    counts = {"host_buffer": 0, "wait_for_copies": 0}
    for name in counts:
        real = getattr(offload, name)

        def hook(*args, _real=real, _name=name):
            counts[_name] += 1
            return _real(*args)

        monkeypatch.setattr(offload, name, hook)
    return counts


def test_host_buffers_are_allocated_once_and_each_offload_waits_once(monkeypatch):
    counts = counted(monkeypatch)
    tensors = [torch.randn(10), torch.randn(3, 4, dtype=torch.float64), torch.arange(6, dtype=torch.int32)]
    originals = [t.clone() for t in tensors]
    for cycle in range(3):
        assert offload.offload_tensors(tensors) == 10 * 4 + 12 * 8 + 6 * 4
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors)  # the "device" memory is released
        assert counts == {"host_buffer": 3, "wait_for_copies": cycle + 1}  # buffers from the first cycle on
        assert offload.onload_tensors(tensors) == 10 * 4 + 12 * 8 + 6 * 4
        assert counts["wait_for_copies"] == cycle + 1  # onload queues its copies, no wait
        for t, o in zip(tensors, originals):
            assert torch.equal(t, o)
        tensors[0].add_(1.0)  # training changes the tensor between offloads: the next offload sees it
        originals[0].add_(1.0)


def test_engine_offload_of_all_parts_waits_once(tiny_models, world_of_one, monkeypatch):
    engine = MegatronEngine(str(tiny_models["llama"]), world_of_one,
                            EngineConfig(param_offload=True, grad_offload=True, optimizer_offload=True))
    before = {k: [t.clone() for t in fn(engine)] for k, fn in offload.PARTS.items()}
    counts = counted(monkeypatch)
    for cycle in range(2):
        moved = engine.offload()
        assert set(moved) == {"params", "grads", "optimizer"} and moved["params"] > 0
        assert counts["wait_for_copies"] == cycle + 1
        engine.onload()
    assert counts["host_buffer"] == sum(len(ts) for ts in before.values())  # the first cycle only
    for part, fn in offload.PARTS.items():
        for t, b in zip(fn(engine), before[part]):
            assert torch.equal(t, b), part
