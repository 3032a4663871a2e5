"""The frozen reference engine: offloaded between uses, back on demand, bit-identical."""
from __future__ import annotations

import torch

from megarl.engine.batch import SequenceBatch
from megarl.engine.engine import EngineConfig, MegatronEngine


def test_reference_offload_round_trip(tiny_models, world_of_one):
    ref = MegatronEngine(str(tiny_models["llama"]), world_of_one, EngineConfig(param_offload=True), trainable=False)
    batch = SequenceBatch([[5, 6, 7, 8, 9], [10, 11, 12]], [2, 1], [0, 1], 3, {"response_mask": torch.ones(2, 3)})
    before_params = {n: p.detach().clone() for n, p in ref.module.named_parameters()}
    before = ref.forward_only(batch).logprobs
    resident = ref.resident_bytes()
    assert resident["params"] > 0 and resident["grads"] == resident["optimizer"] == 0  # frozen: nothing else

    moved = ref.offload()
    assert moved == {"params": resident["params"]} and ref.resident_bytes()["params"] == 0
    after = ref.forward_only(batch).logprobs  # onloads on demand
    assert ref.resident_bytes() == resident and ref.bytes_moved == {"offload": moved["params"], "onload": moved["params"]}
    assert torch.equal(before, after)
    for name, p in ref.module.named_parameters():
        assert torch.equal(p, before_params[name]), name
