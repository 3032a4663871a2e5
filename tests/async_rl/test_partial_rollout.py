"""Partial rollout on the hf engine through the rollout server's loader: weights staged while a
request runs are loaded between two tokens; the response keeps its earlier tokens and log-probs,
continues under the new weights, and each token says the version it was sampled under."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from conftest import stage_at_call
from megarl.async_rollout.server import RolloutServer
from megarl.rollout.base import RolloutRequest, SamplingParams
from megarl.rollout.hf import HFRolloutEngine


def _weights(model_dir):
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _server(engine) -> RolloutServer:
    plan = SimpleNamespace(planned_recv_bytes=[0, 0], needed_bytes=[0, 0], min_recv_bytes=[0, 0])
    return RolloutServer(engine, SimpleNamespace(plan=plan), groups=None, rank=1, partial_rollout=True)


def test_a_response_continued_across_a_weight_update_carries_two_versions(tiny_models):
    old = _weights(tiny_models["llama"])
    new = {name: t * 1.7 if t.ndim == 2 else t for name, t in old.items()}  # a different policy, same shapes
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    requests = [RolloutRequest((5, 6, 7), 0, step=1)]

    reference = HFRolloutEngine.from_hf_dir(str(tiny_models["llama"]))
    server = _server(reference)
    server.staged = (0, old)
    server.load_staged()
    uninterrupted = reference.generate(requests, sampling)
    assert all(r.versions == [0] * 6 for r in uninterrupted)

    engine = HFRolloutEngine.from_hf_dir(str(tiny_models["llama"]))
    server = _server(engine)
    server.staged = (0, old)
    server.load_staged()
    # the receiving thread stages version 1 after token 1 (the second) is sampled
    engine.between_tokens = stage_at_call(server, new, at=2)
    interrupted = engine.generate(requests, sampling)
    for a, b in zip(uninterrupted, interrupted):
        assert b.versions == [0, 0, 1, 1, 1, 1]
        assert b.response_token_ids[:2] == a.response_token_ids[:2] and b.logprobs[:2] == a.logprobs[:2]  # kept
        # the token after the update is scored by the new weights (same seed: a different distribution)
        assert b.scaled_logprobs[2] != a.scaled_logprobs[2] or b.response_token_ids[2] != a.response_token_ids[2]
    assert engine.version == 1 and server.staged is None
    # the new weights are the engine's from then on: a fresh request equals one on a model built with them
    fresh = HFRolloutEngine.from_hf_dir(str(tiny_models["llama"]))
    fresh.load_weights(new.items())
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=4)
    engine.between_tokens = None
    assert engine.generate(requests, greedy)[0].response_token_ids == fresh.generate(requests, greedy)[0].response_token_ids
    assert torch.equal(dict(engine.model.named_parameters())["model.embed_tokens.weight"], new["model.embed_tokens.weight"])
