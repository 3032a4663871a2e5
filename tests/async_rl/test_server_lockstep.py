"""The rollout server's protocol for an engine over several rollout ranks (vLLM at rollout.tp > 1,
whose TP ranks must make the same calls in lockstep) and for engines that do not record versions
(vLLM): the messages are scripted in place of torch.distributed (send_object / recv_object, which
tests/vllm/test_separate_placement.py runs for real), the engine is a fake that records its calls."""
from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
import torch

from megarl.async_rollout import server as server_mod
from megarl.async_rollout.server import RolloutServer
from megarl.rollout.base import RolloutRequest, RolloutResult, SamplingParams

GROUPS = SimpleNamespace(ctrl="ctrl", up="up", down="down")
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=2)
REQUESTS = [RolloutRequest((5, 6), 0)]


class FakeEngine:
    """Models an engine that loads weights between requests only and reports no versions (vLLM)."""

    def __init__(self):
        self.calls = []

    def load_weights(self, weights):
        self.calls.append(("load", {n: float(t.sum()) for n, t in weights}))

    def generate(self, requests, sampling):
        self.calls.append(("generate", [r.prompt_token_ids for r in requests]))
        return [RolloutResult(r.prompt_index, 0, [7, 8], [-0.1, -0.2], "length") for r in requests]


class FakeStream:
    """The HybridEngine on a rollout rank: each stream yields the weights of the next version."""

    def __init__(self):
        self.plan = SimpleNamespace(planned_recv_bytes=[0] * 4, needed_bytes=[0] * 4, min_recv_bytes=[0] * 4)
        self.pushed = 0
        self.last_stats = SimpleNamespace(bytes_received=8, payload_received=8, full_bytes_received=8, changed_fraction=1.0)

    def stream(self):
        self.pushed += 1
        yield "w", torch.full((2,), float(self.pushed))  # version v carries weights full of v + 1


def _script(monkeypatch, inbox: dict[str, list]):
    """recv_object serves `inbox[group]` in order (blocking when empty); send_object records."""
    boxes = {g: queue.Queue() for g in inbox}
    for g, items in inbox.items():
        for item in items:
            boxes[g].put(item)
    sent = []
    monkeypatch.setattr(server_mod, "recv_object", lambda src, group: boxes[group].get(timeout=10))
    monkeypatch.setattr(server_mod, "send_object", lambda obj, dst, group: sent.append((dst, group, obj)))
    return sent


def test_leader_forwards_each_request_with_its_version_and_stamps_versions(monkeypatch):
    engine = FakeEngine()
    sent = _script(monkeypatch, {"ctrl": [("weights", 0), ("generate", 0, 7, REQUESTS, GREEDY, 0), ("stop",)]})
    RolloutServer(engine, FakeStream(), GROUPS, rank=2, partial_rollout=False, engine_ranks=(2, 3)).serve()
    assert engine.calls == [("load", {"w": 2.0}), ("generate", [(5, 6)])]
    # to the follower first (version 0, the same requests), then the result to client 0, then "stop" to the follower
    assert [(dst, group) for dst, group, _ in sent] == [(3, "up"), (0, "up"), (3, "up")]
    assert sent[0][2] == (0, REQUESTS, GREEDY) and sent[2][2] is None
    kind, request_id, results, info = sent[1][2]
    assert (kind, request_id) == ("result", 7)
    assert results[0].versions == [0, 0]  # every token under version 0: what the staleness check reads


def test_follower_loads_exactly_the_leaders_version(monkeypatch):
    """Versions 0 and 1 reach the follower before the leader asks for 0: it generates under 0,
    then under 1, and never sends a result (the leader returns them)."""
    engine = FakeEngine()
    server = RolloutServer(engine, FakeStream(), GROUPS, rank=3, partial_rollout=False, engine_ranks=(2, 3))
    server.pending = {0: {"w": torch.full((2,), 1.0)}, 1: {"w": torch.full((2,), 2.0)}}
    server.staged_version = 1
    sent = _script(monkeypatch, {"ctrl": [("stop",)], "up": [(0, REQUESTS, GREEDY), (1, REQUESTS, GREEDY), None]})
    server.serve()
    assert engine.calls == [("load", {"w": 2.0}), ("generate", [(5, 6)]), ("load", {"w": 4.0}), ("generate", [(5, 6)])]
    assert sent == [] and server.pending == {}


def test_follower_drops_versions_its_leader_skipped(monkeypatch):
    engine = FakeEngine()
    server = RolloutServer(engine, FakeStream(), GROUPS, rank=3, partial_rollout=False, engine_ranks=(2, 3))
    server.pending = {v: {"w": torch.full((1,), float(v))} for v in (0, 1, 2)}
    server._load_exact(1)
    assert engine.version == 1 and list(server.pending) == [2]
    server._load_exact(1)  # already loaded: nothing again
    assert [c[0] for c in engine.calls] == ["load"]


@pytest.mark.parametrize("engine_ranks,leader", [(None, 2), ((2, 3), 2)])
def test_the_first_rank_of_an_engine_leads(engine_ranks, leader):
    server = RolloutServer(FakeEngine(), FakeStream(), GROUPS, rank=2, partial_rollout=False, engine_ranks=engine_ranks)
    assert server.leader == leader
