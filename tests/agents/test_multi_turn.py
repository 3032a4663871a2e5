"""Multi-turn rollouts (megarl.rollout.multi_turn) over the real hf engine: the engine continues
from token ids (never re-encoded), environment tokens carry mask 0, the actor's (Megatron)
log-probs of the policy's tokens equal the engine's, and environment failures become observations
that cost one timeout, never the batch."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from megarl.agents import Environment
from megarl.agents.environment import EnvironmentSpecError, load_environment_class
from megarl.engine.batch import SequenceBatch
from megarl.rollout.base import RolloutRequest, SamplingParams
from megarl.rollout.multi_turn import MultiTurnRollout, MultiTurnSettings, turn_seed

PROMPTS = [(5, 6, 7), (11, 12, 13, 14), (40, 41)]
NEVER = threading.Event()


class Recorder:
    """The real hf engine, with every request it is given kept (to check what history it saw)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.record_routes = engine.record_routes

    def generate(self, requests, sampling):
        self.calls.append((list(requests), sampling))
        return self.engine.generate(requests, sampling)


class Echo(Environment):
    """Answers each turn with "ok <n>"; done after the third turn. reset adds a preamble."""

    def reset(self, row):
        self.n = 0
        return "go" if row.get("preamble") else None

    def step(self, turn):
        self.n += 1
        return f"ok {self.n}", 0.5, self.n == 3


class Troubled(Environment):
    """Turn 0: raises on prompt 0, sleeps forever on prompt 1, returns garbage on prompt 2;
    later turns answer normally; the episode ends after turn 1."""

    def reset(self, row):
        self.prompt, self.n = row["which"], 0

    def step(self, turn):
        self.n += 1
        if self.n == 1 and self.prompt == 0:
            raise KeyError("no such city")
        if self.n == 1 and self.prompt == 1:
            NEVER.wait()
        if self.n == 1 and self.prompt == 2:
            return "just text"
        return "fine", 1.0, self.n == 2


@pytest.fixture(scope="module")
def hf(tiny_models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.rollout.hf import HFRolloutEngine

    model_dir = tiny_models["qwen3"]
    return HFRolloutEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)), \
        AutoTokenizer.from_pretrained(model_dir), model_dir


def _requests():
    return [RolloutRequest(p, i, step=3) for i, p in enumerate(PROMPTS)]


def _run(hf, env_class, settings, sampling, rows=None):
    engine, tokenizer, _ = hf
    recorder = Recorder(engine)
    mt = MultiTurnRollout(recorder, env_class, tokenizer, settings)
    mt.rows = rows or {i: {"which": i} for i in range(len(PROMPTS))}
    return mt.generate(_requests(), sampling), recorder, tokenizer


def test_episode_tokens_masks_and_history_as_sampled(hf):
    settings = MultiTurnSettings(max_turns=5, max_tokens_per_turn=4, max_total_tokens=40)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=7)
    rows = {i: {"preamble": i == 0} for i in range(3)}
    results, recorder, tok = _run(hf, Echo, settings, sampling, rows)
    assert len(results) == 6 and [(r.prompt_index, r.sample_index) for r in results] == [(i, j) for i in range(3) for j in range(2)]
    go, obs = tok.encode("go", add_special_tokens=False), [tok.encode(f"ok {n}", add_special_tokens=False) for n in (1, 2)]
    for r in results:
        # [preamble], turn 0, "ok 1", turn 1, "ok 2", turn 2 (done: the third observation is not appended)
        mask, ids = r.response_mask, r.response_token_ids
        assert len(mask) == len(ids) == len(r.logprobs) == len(r.scaled_logprobs)
        pieces, pos = [], 0
        while pos < len(mask):  # runs of equal mask
            end = pos
            while end < len(mask) and mask[end] == mask[pos]:
                end += 1
            pieces.append((mask[pos], ids[pos:end]))
            pos = end
        env_pieces = [p for m, p in pieces if m == 0]
        assert env_pieces == ([go] if r.prompt_index == 0 else []) + obs
        assert [m for m, _ in pieces] == ([0] if r.prompt_index == 0 else []) + [1, 0, 1, 0, 1]
        assert all(lp == 0.0 for lp, m in zip(r.logprobs, mask) if m == 0)
        assert all(lp < 0.0 or lp == 0.0 for lp, m in zip(r.logprobs, mask) if m == 1)
        assert r.env_reward == 1.5 and r.episode == {"turns": 3, "observations": 2, "errors": 0, "timeouts": 0, "template_mismatch": 0}
    # every turn was asked of the engine as prompt + the response so far, token for token, with the turn's seed
    assert len(recorder.calls) == 3
    for turn, (requests, turn_sampling) in enumerate(recorder.calls):
        assert turn_sampling.n == 1 and turn_sampling.max_new_tokens == 4
        for req, r in zip(requests, results):
            assert req.prompt_token_ids[: len(PROMPTS[r.prompt_index])] == PROMPTS[r.prompt_index]
            so_far = req.prompt_token_ids[len(PROMPTS[r.prompt_index]):]
            assert list(so_far) == r.response_token_ids[: len(so_far)]
            assert req.seed == turn_seed(_seed(r, sampling), turn)
    # without a preamble, the first turn is the single-turn sample itself (same seed)
    alone = hf[0].generate(_requests(), SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=7))
    for r, a in zip(results[2:], alone[2:]):
        assert r.response_token_ids[: len(a.response_token_ids)] == a.response_token_ids


class NewWeightsEachTurn(Recorder):
    """The real hf engine under a policy version that grows by one each turn (as new weights
    reaching a rollout rank between an episode's turns would)."""

    def generate(self, requests, sampling):
        self.engine.version = len(self.calls)
        try:
            return super().generate(requests, sampling)
        finally:
            self.engine.version = 0


def test_episode_versions_are_the_policy_tokens_own(hf):
    """Each policy token keeps the version it was sampled under; an environment token takes the
    version of the policy token before it (a preamble: the first turn's), so a sample's staleness
    is its oldest policy token's (megarl.async_rollout)."""
    engine, tokenizer, _ = hf
    mt = MultiTurnRollout(NewWeightsEachTurn(engine), Echo, tokenizer, MultiTurnSettings(max_turns=5, max_tokens_per_turn=4, max_total_tokens=40))
    mt.rows = {i: {"preamble": i == 0} for i in range(3)}
    for r in mt.generate(_requests(), SamplingParams(n=1, temperature=1.0, max_new_tokens=40, seed=7)):
        assert len(r.versions) == len(r.response_token_ids)
        expected, turn, prev = [], -1, 0
        for m in r.response_mask:  # Echo answers every turn: each run of mask 1 is one policy turn
            turn += m == 1 and prev == 0
            expected.append(max(turn, 0))
            prev = m
        assert r.response_mask.count(0) > 0 and max(expected) == 2  # three turns, two observations
        assert r.versions == expected, (r.response_mask, r.versions)


def _seed(result, sampling):
    from megarl.rollout.base import make_sample_seed

    return make_sample_seed(sampling.seed, 3, result.prompt_index, result.sample_index)


def test_actor_logprobs_of_policy_tokens_equal_the_engines_after_an_episode(hf, world_of_one):
    """What the trainer computes (Megatron forward over the whole concatenated sequence, at the
    sampling temperature) equals what the engine sampled with, on every policy token."""
    from megarl.engine.engine import EngineConfig, MegatronEngine

    settings = MultiTurnSettings(max_turns=3, max_tokens_per_turn=5, max_total_tokens=24)
    sampling = SamplingParams(n=2, temperature=0.8, max_new_tokens=24, seed=1)
    results, _, _ = _run(hf, Echo, settings, sampling, {i: {"preamble": True} for i in range(3)})
    actor = MegatronEngine(str(hf[2]), world_of_one, EngineConfig(), trainable=False)
    R = settings.max_total_tokens
    mask, engine_lp = torch.zeros(len(results), R), torch.zeros(len(results), R)
    for i, r in enumerate(results):
        mask[i, : len(r.response_mask)] = torch.tensor(r.response_mask, dtype=torch.float32)
        engine_lp[i, : len(r.scaled_logprobs)] = torch.tensor(r.scaled_logprobs)
    batch = SequenceBatch([list(PROMPTS[r.prompt_index]) + r.response_token_ids for r in results],
                          [len(PROMPTS[r.prompt_index]) for r in results], list(range(len(results))), R, {"response_mask": mask})
    actor_lp = actor.forward_only(batch, temperature=sampling.temperature).logprobs
    on = mask.bool()
    assert (mask == 0).logical_and(torch.arange(R) < torch.tensor([len(r.response_mask) for r in results])[:, None]).sum() > 0
    assert (actor_lp - engine_lp)[on].abs().max() < 2e-5  # float32 noise


def test_failing_environments_become_observations_and_cost_one_timeout(hf):
    settings = MultiTurnSettings(max_turns=4, max_tokens_per_turn=3, max_total_tokens=200, timeout_s=1.0)
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=200, seed=2)
    start = time.monotonic()
    results, _, tok = _run(hf, Troubled, settings, sampling)
    elapsed = time.monotonic() - start
    NEVER.set()  # lets the abandoned thread finish
    assert elapsed < 1.0 + 10.0, elapsed  # one timeout, not one per turn or per sample
    expected = ["[tool error] KeyError: 'no such city'", "[tool timeout] no result after 1 s",
                "[tool error] step returned 'just text', not (observation, reward, done)"]
    for r, failure in zip(results, expected):
        env_ids = [t for t, m in zip(r.response_token_ids, r.response_mask) if m == 0]
        # the failure's text, then the second turn's "fine" is not appended (done)
        assert env_ids == tok.encode(failure, add_special_tokens=False)
        assert r.episode["turns"] == 2 and r.env_reward == 1.0
    assert [(r.episode["errors"], r.episode["timeouts"]) for r in results] == [(1, 0), (0, 1), (1, 0)]


def test_token_budgets(hf):
    # max_total_tokens cuts the observation and ends the episode; every turn is at most max_tokens_per_turn
    settings = MultiTurnSettings(max_turns=10, max_tokens_per_turn=3, max_total_tokens=9)
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=9, seed=3)

    class Long(Environment):
        def step(self, turn):
            assert len(turn.token_ids) <= 3
            return "a long observation of many tokens", 0.0, False

    results, _, tok = _run(hf, Long, settings, sampling)
    observation = tok.encode("a long observation of many tokens", add_special_tokens=False)
    assert len(observation) > 6
    for r in results:  # no stop tokens: turn 0 is 3 tokens, the observation is cut to the 6 left, the episode ends
        assert r.response_mask == [1, 1, 1, 0, 0, 0, 0, 0, 0] and r.finish_reason == "length"
        assert r.response_token_ids[3:] == observation[:6] and r.episode["turns"] == 1


def test_environment_spec_errors_name_the_fix(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text("class Env:\n    def reset(self, row): pass\n    def step(self, turn): return None, 1.0, True\n"
                                        "class Half:\n    def reset(self, row): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_environment_class("my_envs:Env").__name__ == "Env"
    for spec, words in (("my_envs.Env", "expected 'module:Class'"), ("nope_envs:Env", "put its directory on PYTHONPATH"),
                        ("my_envs:Other", "has no class 'Other'"), ("my_envs:Half", "lacks step")):
        with pytest.raises(EnvironmentSpecError, match=words):
            load_environment_class(spec)


def test_score_sits_on_the_last_policy_token_and_the_batch_keeps_the_holes():
    """A response whose mask has holes (the environment's tokens): the sequence score goes on its
    last policy token, not at (number of policy tokens - 1), which may be an observation's."""
    from megarl.data.dataset import PromptRow
    from megarl.step.advantages import scores_at_last_token
    from megarl.step.samples import Sample, to_rollout_batch

    row = PromptRow(global_index=0, row=0, prompt="p", ground_truth="", data_source="", prompt_ids=[7, 8])
    samples = [Sample(row, 0, [1, 2, 3, 4, 5], [-0.5, -0.25, 0.0, 0.0, -1.0], True, "", response_mask=[1, 1, 0, 0, 1]),
               Sample(row, 1, [6, 9], [-2.0, 0.0], True, "", response_mask=[1, 0]),
               Sample(row, 2, [4, 4, 4], [-1.0, -1.0, -1.0], True, "")]  # single-turn: all the policy's
    batch = to_rollout_batch(samples, samples_per_prompt=3, response_len=6)
    mask = batch.batch.response_mask
    assert mask.tolist() == [[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]]
    assert batch.rollout_logprobs[0].tolist() == [-0.5, -0.25, 0.0, 0.0, -1.0, 0.0]
    rewards = scores_at_last_token(torch.tensor([2.0, 3.0, 5.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 2.0, 0], [3.0, 0, 0, 0, 0, 0], [0, 0, 5.0, 0, 0, 0]]
