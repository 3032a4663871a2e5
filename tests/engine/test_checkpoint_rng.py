"""Engine checkpoints carry each rank's RNG states, restored under the layout that wrote them."""
from __future__ import annotations

import random

import numpy as np
import torch

from megarl.engine.checkpointing import restore_rng_state, rng_state
from megarl.engine.engine import EngineConfig, MegatronEngine


def _draw() -> tuple:
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():  # the stream dropout would use under TP
        tracked = torch.rand(3)
    return torch.rand(3), random.random(), float(np.random.rand()), tracked


def test_rng_states_round_trip_through_an_engine_checkpoint(tiny_models, world_of_one, tmp_path):
    engine = MegatronEngine(str(tiny_models["qwen2"]), world_of_one, EngineConfig())
    engine.save(str(tmp_path / "ckpt"))
    expected = _draw()
    _draw()  # move every stream on
    engine.load(str(tmp_path / "ckpt"))
    got = _draw()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[3], expected[3])
    assert got[1:3] == expected[1:3]


def test_rng_states_of_another_layout_are_left_alone(world_of_one):
    state = rng_state(world_of_one)
    before = torch.get_rng_state()
    state["layout"] = (2,) + state["layout"][1:]  # written by a two-process job
    state["torch"] = torch.zeros_like(state["torch"])
    assert not restore_rng_state(state, world_of_one)
    assert torch.equal(torch.get_rng_state(), before)
