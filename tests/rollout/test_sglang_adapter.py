"""The SGLang adapter against a recording stand-in for sglang 0.5.23 (no CUDA needed)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import free_port, spawn
from fake_engines import fake_tokens, make_fake_sglang, sglang_two_rank_worker
from megarl.rollout.base import MissingEngineError, RolloutRequest, SamplingParams, make_sample_seed


@pytest.fixture
def fake_sglang(monkeypatch):
    mods = make_fake_sglang()
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods["sglang"]


def test_missing_sglang_names_the_extra_and_version(monkeypatch):
    from megarl.rollout.sglang import import_sglang

    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(MissingEngineError, match=r"sglang==0\.5\.23.*pip install 'megarl\[sglang\]'"):
        import_sglang()


def test_other_sglang_version_warns(monkeypatch):
    from megarl.rollout.sglang import import_sglang

    for name, mod in make_fake_sglang("0.5.12").items():
        monkeypatch.setitem(sys.modules, name, mod)
    with pytest.warns(UserWarning, match="targets sglang==0.5.23 but 0.5.12"):
        import_sglang()


def test_groups_must_be_consecutive(fake_sglang):
    from megarl.rollout.sglang import SGLangConfig, SGLangRolloutEngine

    with pytest.raises(ValueError, match="consecutive"):
        SGLangRolloutEngine(SGLangConfig("/m", tp_size=2), group=None, group_ranks=[0, 2])


def test_call_sequence_of_one_step(fake_sglang, monkeypatch):
    from megarl.rollout.sglang import SGLangConfig, SGLangRolloutEngine

    monkeypatch.setenv("LOCAL_RANK", "0")
    engine = SGLangRolloutEngine(SGLangConfig("/models/tiny", random_seed=5, nccl_port_base=30000, mem_fraction_static=0.4,
                                              update_bucket_bytes=8), group=None, group_ranks=[0])
    calls = fake_sglang.calls
    assert calls[0] == ("Engine", dict(model_path="/models/tiny", tp_size=1, base_gpu_id=0, gpu_id_step=1, nccl_port=30000,
                                       enable_memory_saver=True, load_format="dummy", skip_tokenizer_init=True, random_seed=5,
                                       enable_deterministic_inference=True, dtype="auto", mem_fraction_static=0.4))
    assert calls[1] == ("release_memory_occupation", ("kv_cache", "weights"))

    reqs = [RolloutRequest((5, 6), prompt_index=8, step=1)]
    sampling = SamplingParams(n=2, temperature=1.0, top_k=0, max_new_tokens=3, stop_token_ids=(2,), seed=4)
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(reqs, sampling)

    del calls[:]
    # 8-byte buckets: each 2-float tensor is its own update_weights_from_tensor call
    engine.load_weights([("a", torch.ones(2)), ("b", torch.full((2,), 2.0)), ("c", torch.zeros(1))])
    engine.resume_memory()
    assert [c[0] for c in calls] == ["monkey_patch_torch_reductions", "resume_memory_occupation", "begin_weight_update",
                                     "update_weights_from_tensor", "update_weights_from_tensor", "update_weights_from_tensor",
                                     "end_weight_update", "flush_cache", "resume_memory_occupation"]
    assert calls[1] == ("resume_memory_occupation", ("weights",)) and calls[-1] == ("resume_memory_occupation", ("kv_cache",))
    assert [c[1:] for c in calls if c[0] == "update_weights_from_tensor"] == [(["a"], False), (["b"], False), (["c"], False)]
    assert torch.equal(engine.engine.weights["b"][0], torch.full((2,), 2.0))

    del calls[:]
    results = engine.generate(reqs, sampling)
    (_, input_ids, params, return_logprob), = calls
    seeds = [make_sample_seed(4, 1, 8, j) for j in range(2)]
    assert return_logprob is True and input_ids == [[5, 6], [5, 6]]
    assert params == [dict(max_new_tokens=3, temperature=1.0, top_p=1.0, top_k=-1, stop_token_ids=[2], ignore_eos=False,
                          sampling_seed=s) for s in seeds]
    assert results[1].response_token_ids == fake_tokens(seeds[1], [5, 6])
    assert results[1].logprobs == [-0.25, -0.5, -0.75] == results[1].scaled_logprobs
    assert results[1].finish_reason == "length"

    del calls[:]
    engine.release_memory()
    engine.release_memory()
    engine.close()
    assert calls == [("release_memory_occupation", ("kv_cache", "weights")), ("shutdown",)]


def test_nondeterministic_mode_warns_that_seeds_are_ignored(fake_sglang):
    from megarl.rollout.sglang import SGLangConfig, SGLangRolloutEngine

    with pytest.warns(UserWarning, match="ignores sampling_seed"):
        SGLangRolloutEngine(SGLangConfig("/m", deterministic=False), group=None, group_ranks=[0])


@pytest.mark.multiprocess
def test_two_rank_group_gathers_weights_to_owner_and_broadcasts_results(tmp_path):
    import json

    spawn(sglang_two_rank_worker, 2, str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    assert r0["ids"] == r1["ids"] and len(r0["ids"]) == 2
    assert r0["w"] == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]  # values[r] came from group rank r
    assert r0["calls"].count("Engine") == 1 and r0["calls"].count("generate") == 1


def _one_sample(engine, sampling, prompt=(5, 6)):
    engine.load_weights([("a", torch.ones(2))])
    engine.resume_memory()
    (result,) = engine.generate([RolloutRequest(prompt, prompt_index=0)], sampling)
    return result


def test_stops_at_a_stop_token_and_keeps_it(fake_sglang):
    """The fake applies SGLang 0.5.23's rule (ignore_eos skips stop_token_ids too): sending
    ignore_eos=True with stop ids, as megarl did, ran every response to max_new_tokens."""
    from megarl.rollout.sglang import SGLangConfig, SGLangRolloutEngine

    engine = SGLangRolloutEngine(SGLangConfig("/m"), group=None, group_ranks=[0])
    seed = make_sample_seed(7, 0, 0, 0)
    free = fake_tokens(seed, [5, 6], 6)
    stop = free[2]
    assert stop not in free[:2]
    result = _one_sample(engine, SamplingParams(max_new_tokens=6, stop_token_ids=(stop, 1), seed=7))
    assert result.response_token_ids == free[:3] and result.finish_reason == "stop"
    assert result.logprobs == [-0.25, -0.5, -0.75]


def test_without_stop_ids_runs_to_max_new_tokens_past_the_models_eos(fake_sglang):
    """rollout.ignore_eos: the trainer passes no stop ids, so SGLang's own eos must not stop it either."""
    from megarl.rollout.sglang import SGLangConfig, SGLangRolloutEngine

    engine = SGLangRolloutEngine(SGLangConfig("/m"), group=None, group_ranks=[0])
    free = fake_tokens(make_sample_seed(7, 0, 0, 0), [5, 6], 6)
    fake_sglang.Engine.model_eos_token_ids = (free[0],)
    try:
        result = _one_sample(engine, SamplingParams(max_new_tokens=6, stop_token_ids=(), seed=7))
    finally:
        fake_sglang.Engine.model_eos_token_ids = ()
    assert result.response_token_ids == free and result.finish_reason == "length"


def test_ignore_eos_with_stop_ids_on_sglang_is_a_config_error():
    from megarl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"rollout.ignore_eos with rollout.stop_token_ids = \[7\] on rollout.engine=sglang"):
        load_config("configs/tiny_cpu.yaml", ["rollout.engine=sglang", "rollout.ignore_eos=true", "rollout.stop_token_ids=[7]"])
    for overrides in (["rollout.engine=sglang", "rollout.ignore_eos=true"], ["rollout.engine=sglang", "rollout.stop_token_ids=[7]"],
                      ["rollout.engine=vllm", "rollout.ignore_eos=true", "rollout.stop_token_ids=[7]"]):
        load_config("configs/tiny_cpu.yaml", overrides)


def test_schedulers_do_not_inherit_torchruns_agent_store_flag(fake_sglang, monkeypatch):
    """Under torchrun, SGLang's scheduler processes must not see TORCHELASTIC_USE_AGENT_STORE (with it,
    each becomes a client of a store nobody serves); the trainer process keeps it."""
    from megarl.rollout.sglang import SGLangConfig, SGLangRolloutEngine

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    engine = SGLangRolloutEngine(SGLangConfig("/m"), group=None, group_ranks=[0])
    assert "TORCHELASTIC_USE_AGENT_STORE" not in engine.engine.scheduler_env
    assert engine.engine.scheduler_env["TORCHELASTIC_RESTART_COUNT"] == "0"
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"

    def failing_engine(**kw):
        raise RuntimeError("scheduler died")

    monkeypatch.setattr(fake_sglang, "Engine", failing_engine)
    with pytest.raises(RuntimeError, match="scheduler died"):
        SGLangRolloutEngine(SGLangConfig("/m"), group=None, group_ranks=[0])
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"


# What SGLang's schedulers do first (sglang/srt/distributed/parallel_state.py): a tcp:// rendezvous on
# 127.0.0.1:<nccl_port>, where scheduler rank 0 must serve the store. One rank is enough to see it.
_SCHEDULER_RENDEZVOUS = ("import datetime, sys, torch.distributed as dist; "
                         "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{sys.argv[1]}', rank=0, "
                         "world_size=1, timeout=datetime.timedelta(seconds=5)); print('rendezvous done')")


@pytest.mark.multiprocess
def test_a_scheduler_started_with_the_recorded_environment_can_rendezvous(fake_sglang, monkeypatch):
    """Real torch, in a process started with the environment the fake Engine recorded at spawn: the
    scheduler's rendezvous completes. With torchrun's environment (the control) torch makes rank 0 a
    client of a store nobody serves, and it times out."""
    from megarl.rollout.sglang import SGLangConfig, SGLangRolloutEngine

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    engine = SGLangRolloutEngine(SGLangConfig("/m"), group=None, group_ranks=[0])

    def scheduler(env):
        return subprocess.run([sys.executable, "-c", _SCHEDULER_RENDEZVOUS, str(free_port())], env=env,
                              capture_output=True, text=True, timeout=300)

    started = scheduler(engine.engine.scheduler_env)
    assert started.returncode == 0 and "rendezvous done" in started.stdout, started.stderr[-2000:]
    control = scheduler(dict(os.environ))
    assert control.returncode != 0 and "rendezvous done" not in control.stdout
