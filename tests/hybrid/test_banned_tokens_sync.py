"""rollout.banned_token_ids is part of the policy (issue 21, item 1; gpu-paths F6): the actor's
log-probs (Megatron forward, what the trainer computes for old, reference and current log-probs)
equal the hf engine's log-probs of its own samples with bans on, at float32 noise, and the
post-sync check passes on correct weights when the banned tokens hold most of the mass."""
from __future__ import annotations

import pytest
import torch

from megarl.engine.batch import SequenceBatch
from megarl.engine.engine import EngineConfig, MegatronEngine
from megarl.hybrid.verify import WeightSyncMismatch, check_sync
from megarl.rollout.base import RolloutRequest, SamplingParams, pad_results
from banned_mass import heavy_tokens

PROMPTS = [(5, 6, 7), (11,), (40, 41, 42, 43), (200, 3)]


@pytest.fixture(scope="module")
def engines(tiny_models, world_of_one):
    from transformers import AutoModelForCausalLM

    from megarl.rollout.hf import HFRolloutEngine

    model_dir = str(tiny_models["qwen3"])
    hf = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    actor = MegatronEngine(model_dir, world_of_one, EngineConfig(), trainable=False)
    return hf, actor


def _batch(results, response_len: int) -> tuple[SequenceBatch, torch.Tensor, torch.Tensor]:
    padded = pad_results(results, use_scaled=True)
    prompts = [PROMPTS[r.prompt_index] for r in results]
    width = padded.mask.shape[1]
    mask, logprobs = torch.zeros(len(results), response_len), torch.zeros(len(results), response_len)
    mask[:, :width], logprobs[:, :width] = padded.mask.float(), padded.logprobs
    batch = SequenceBatch([list(p) + list(r.response_token_ids) for p, r in zip(prompts, results)],
                          [len(p) for p in prompts], list(range(len(results))), response_len, {"response_mask": mask})
    return batch, logprobs, mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_actor_logprobs_equal_hf_engine_logprobs_when_bans_hold_most_of_the_mass(engines, temperature):
    hf, actor = engines
    banned = heavy_tokens(hf.model, min_mass=0.75)
    sampling = SamplingParams(n=4, temperature=temperature, max_new_tokens=8, seed=5, banned_token_ids=banned)
    results = hf.generate([RolloutRequest(p, i) for i, p in enumerate(PROMPTS)], sampling)
    assert not {t for r in results for t in r.response_token_ids} & set(banned)
    batch, engine_lp, mask = _batch(results, sampling.max_new_tokens)

    actor_lp = actor.forward_only(batch, temperature=temperature, banned_token_ids=banned).logprobs
    full_lp = actor.forward_only(batch, temperature=temperature).logprobs  # what the actor computed before
    on = mask.bool()
    banned_mass = 1.0 - (full_lp[on] - actor_lp[on]).exp()  # log p_allowed = log p_full - log(1 - banned mass)
    assert banned_mass.mean() > 0.5, "the test needs the banned tokens to hold most of the mass"

    assert (actor_lp - engine_lp)[on].abs().max() < 2e-5  # float32 noise
    stats = check_sync(engine_lp, actor_lp, mask, "float32", where="rollout.engine=hf")  # the trainer's check passes
    assert stats["mean"] < 1e-5
    with pytest.raises(WeightSyncMismatch):  # the full-vocabulary actor (today's main) fails correct weights
        check_sync(engine_lp, full_lp, mask, "float32")


def test_entropy_is_over_the_allowed_vocabulary(engines):
    hf, actor = engines
    banned = heavy_tokens(hf.model, min_mass=0.75)
    results = hf.generate([RolloutRequest(p, i) for i, p in enumerate(PROMPTS)],
                          SamplingParams(n=1, temperature=1.0, max_new_tokens=4, seed=1, banned_token_ids=banned))
    batch, _, mask = _batch(results, 4)
    got = actor.forward_only(batch, entropy=True, banned_token_ids=banned).entropy
    # transformers' logits of the same positions, banned columns at -inf
    want = torch.zeros_like(got)
    with torch.no_grad():
        for i, seq in enumerate(batch.input_ids):
            logits = hf.model(torch.tensor([seq])).logits[0].float()
            start = batch.prompt_lens[i] - 1
            resp = logits[start : start + int(mask[i].sum())]
            logp = resp.index_fill(-1, torch.tensor(banned), float("-inf")).log_softmax(-1)
            want[i, : len(resp)] = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
    torch.testing.assert_close(got * mask, want, rtol=0, atol=2e-5)
