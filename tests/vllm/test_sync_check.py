"""The post-sync check (megarl.hybrid.verify.check_sync) against real vLLM in bfloat16: correct
weights pass although bf16 kernels put single tail tokens beyond the old max-based bound, and one
corrupted layer is caught. float32 is checked the same way in test_vllm_engine.py.

The actor stand-in is transformers in the same dtype (the trainer's actor is Megatron-Core: other
kernels again, the same rounding scale). Numbers measured this way are at megarl.hybrid.verify.SYNC_CHECKS.
"""
from __future__ import annotations

import pytest
import torch

from megarl.hybrid.verify import WeightSyncMismatch, check_sync
from vllm_models import make_vllm_model, perturbed_state, sampled_batch_gap, transformers_model

SIZES = dict(layers=4, hidden=256, intermediate=512, heads=8, kv_heads=4)  # head_dim 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_vllm_model(tmp_path_factory.mktemp("sync_check") / "llama", **SIZES)


@pytest.fixture(scope="module")
def bf16_engine(world_of_one, model_dir):
    from megarl.rollout import build_rollout

    setup = build_rollout("vllm", str(model_dir), world_of_one.rollout_groups(1), dtype=torch.bfloat16, max_model_len=64,
                          weight_sync="full")  # these tests feed HF tensors straight to load_weights
    yield setup.engine
    setup.engine.close()


def test_bf16_correct_weights_pass_and_a_scaled_layer_is_caught(bf16_engine, model_dir):
    state = perturbed_state(model_dir, 1)
    actor = transformers_model(model_dir, state).to(torch.bfloat16)
    engine_lp, actor_lp, mask = sampled_batch_gap(bf16_engine, actor, state)
    stats = check_sync(engine_lp, actor_lp, mask, "bfloat16")
    assert stats["mean"] > 1e-3  # real bf16 rounding is there (this is not a float32 run)

    corrupted = dict(state)
    corrupted["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"] * 1.5
    engine_lp, actor_lp, mask = sampled_batch_gap(bf16_engine, actor, corrupted)
    with pytest.raises(WeightSyncMismatch, match="bfloat16"):
        check_sync(engine_lp, actor_lp, mask, "bfloat16", where="rollout.engine=vllm (llama model)")
