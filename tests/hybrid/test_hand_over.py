"""The trainer's switch to rollout (HybridEngine.hand_over): weights are loaded while the training
parameters are still there, the training state is offloaded, PyTorch's cached device blocks are
returned, and only then is the engine's KV cache woken, so it can use the memory training held."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from megarl.hybrid import HybridEngine, RolloutLayout, TrainLayout
from megarl.models.sharding import ShardMeta


@pytest.fixture
def one_rank():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class RecordingEngine:
    def __init__(self, events):
        self.events, self.loaded = events, {}

    def load_weights(self, weights):
        self.loaded = {n: t.clone() for n, t in weights}
        self.events.append("load_weights")

    def resume_memory(self):
        self.events.append("resume_memory")


def test_hand_over_wakes_the_kv_cache_last(one_rank, monkeypatch):
    import megarl.hybrid.engine as engine_mod

    events: list[str] = []
    weight = torch.arange(6.0).reshape(2, 3)
    shards = {"w": (weight, ShardMeta(full_shape=(2, 3), tp_dim=None, tp_rank=0, tp_size=1))}
    hybrid = HybridEngine(shards, train=TrainLayout(tp=1, pp=1, dp=1), rollout=RolloutLayout(tp=1))
    monkeypatch.setattr(engine_mod, "release_cached_device_memory", lambda: events.append("empty_cache"))
    engine = RecordingEngine(events)
    stats = hybrid.hand_over(engine, offload=lambda: events.append("offload"))
    assert events == ["load_weights", "offload", "empty_cache", "resume_memory"]
    assert torch.equal(engine.loaded["w"], weight) and stats.bytes_received == 0


def test_release_cached_device_memory_empties_the_cuda_cache(monkeypatch):
    import megarl.hybrid.engine as engine_mod

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    engine_mod.release_cached_device_memory()
    assert calls == ["empty_cache"]
