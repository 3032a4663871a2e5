"""rollout.banned_token_ids: banned tokens are never sampled, in the hf engine (sampling and greedy)
and in what the vLLM / SGLang adapters ask their engines for (issue 11, item 1)."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from megarl.rollout.base import RolloutRequest, SamplingParams
from megarl.rollout.sampling import process_logits, sample_rows
from fake_engines import SGLANG_SAMPLING_KEYS, make_fake_vllm


def test_banned_tokens_leave_both_the_processed_and_the_scaled_distribution():
    logits = torch.log(torch.tensor([[0.4, 0.1, 0.2, 0.3]]))
    processed, scaled = process_logits(logits, temperature=1.0, top_k=0, top_p=1.0, banned_token_ids=(0, 3))
    # allowed tokens 1, 2 with mass 0.1 : 0.2 -> renormalised 1/3, 2/3
    assert processed[0, 0] == -math.inf and processed[0, 3] == -math.inf
    assert torch.allclose(processed[0, 1:3].exp(), torch.tensor([1 / 3, 2 / 3]))
    # a ban is part of the policy: the scaled log-probs (what the actor recomputes) drop it too
    assert torch.allclose(scaled.exp(), torch.tensor([[0.0, 1 / 3, 2 / 3, 0.0]]))


def test_top_k_counts_allowed_tokens_only():
    logits = torch.log(torch.tensor([[0.4, 0.1, 0.2, 0.3]]))
    processed, _ = process_logits(logits, temperature=1.0, top_k=1, top_p=1.0, banned_token_ids=(0,))
    assert processed[0].argmax().item() == 3 and processed[0, 3].item() == pytest.approx(0.0)


def test_greedy_never_picks_a_banned_token():
    logits = torch.tensor([[5.0, 1.0, 2.0]])
    processed, scaled = process_logits(logits, temperature=0.0, top_k=0, top_p=1.0, banned_token_ids=(0,))
    assert sample_rows(processed, [None], greedy=True).tolist() == [2]
    assert torch.allclose(scaled.exp(), torch.softmax(torch.tensor([[-math.inf, 1.0, 2.0]]), -1))


def test_sampling_never_draws_a_banned_token():
    logits = torch.tensor([[8.0, 0.0, 0.0, 8.0]]).repeat(2000, 1)  # tokens 0 and 3 hold ~all the mass
    processed, _ = process_logits(logits, temperature=1.0, top_k=0, top_p=1.0, banned_token_ids=(0, 3))
    drawn = sample_rows(processed, [torch.Generator().manual_seed(i) for i in range(2000)], greedy=False)
    assert set(drawn.tolist()) == {1, 2}


def test_a_stop_token_cannot_be_banned():
    with pytest.raises(ValueError, match="both stop tokens and banned"):
        SamplingParams(stop_token_ids=(2,), banned_token_ids=(2, 0))


def test_hf_engine_never_emits_banned_tokens(tiny_models):
    from transformers import AutoModelForCausalLM

    from megarl.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.float32))
    reqs = [RolloutRequest((5, 6, 7), 0), RolloutRequest((11,), 1)]
    free = engine.generate(reqs, SamplingParams(n=8, temperature=1.0, max_new_tokens=6, seed=3))
    counts = Counter(t for r in free for t in r.response_token_ids)
    banned = tuple(t for t, _ in counts.most_common(5))  # tokens the engine does sample when nothing is banned
    results = engine.generate(reqs, SamplingParams(n=8, temperature=1.0, max_new_tokens=6, seed=3, banned_token_ids=banned))
    greedy = engine.generate(reqs, SamplingParams(temperature=0.0, max_new_tokens=6, banned_token_ids=banned))
    emitted = {t for r in results + greedy for t in r.response_token_ids}
    assert emitted and not emitted & set(banned)
    greedy_free = engine.generate(reqs, SamplingParams(temperature=0.0, max_new_tokens=6))
    greedy_banned = engine.generate(reqs, SamplingParams(temperature=0.0, max_new_tokens=6,
                                                         banned_token_ids=(greedy_free[0].response_token_ids[0],)))
    assert greedy_banned[0].response_token_ids[0] != greedy_free[0].response_token_ids[0]


def test_vllm_adapter_bans_through_logit_bias():
    from megarl.rollout.vllm_sampling import to_vllm_sampling

    vllm = make_fake_vllm()
    banned = to_vllm_sampling(vllm, SamplingParams(max_new_tokens=3, banned_token_ids=(3, 0)), seed=1)
    assert banned.logit_bias == {0: -math.inf, 3: -math.inf}
    assert not hasattr(to_vllm_sampling(vllm, SamplingParams(max_new_tokens=3), seed=1), "logit_bias")


def test_sglang_adapter_bans_through_logit_bias():
    from megarl.rollout.sglang import to_sglang_sampling

    assert to_sglang_sampling(SamplingParams(banned_token_ids=(1,)), seed=1)["logit_bias"] == {"1": -math.inf}
    assert "logit_bias" not in to_sglang_sampling(SamplingParams(), seed=1)
    assert "logit_bias" in SGLANG_SAMPLING_KEYS  # a key SGLang's sampling params accept
