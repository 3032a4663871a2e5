"""The weight sync reads the actor's parameters and nothing else: with everything offloaded,
`MegatronEngine.local_weight_shards` brings back only the parameters (the gradients and optimizer
state stay on the host until the update needs them), so one sync costs one parameter round trip,
not a round trip of the whole training state (the planner counts it so: megarl/capacity/estimate.py)."""
from __future__ import annotations

import torch

from megarl.engine.engine import EngineConfig, MegatronEngine


def test_local_weight_shards_onloads_only_the_parameters(world_of_one, tmp_path):
    from megarl.tools.make_tiny_model import make_tiny_model

    make_tiny_model("llama", tmp_path / "m", seed=0)
    cfg = EngineConfig(param_offload=True, grad_offload=True, optimizer_offload=True)
    actor = MegatronEngine(str(tmp_path / "m"), world_of_one, cfg)
    held = actor.resident_bytes()
    assert held["params"] > 0 and held["grads"] > 0
    moved = actor.offload()
    assert set(moved) >= {"params", "grads"} and actor.resident_bytes()["params"] == 0

    shards = actor.local_weight_shards()
    assert actor.bytes_moved["onload"] == moved["params"]  # the parameters, and only they, came back
    resident = actor.resident_bytes()
    assert resident["params"] == held["params"] and resident["grads"] == 0 and resident["optimizer"] == 0
    name, (tensor, _) = next(iter(shards.items()))
    assert tensor.untyped_storage().nbytes() > 0 and torch.isfinite(tensor).all(), name

    actor.offload()  # the trainer's hand-over: the parameters leave again, the rest was never back
    assert actor.bytes_moved["offload"] == sum(moved.values()) + moved["params"]
    actor.onload()  # the update brings everything back
    assert actor.resident_bytes() == held
