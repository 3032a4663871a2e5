"""The hf engine: greedy parity with transformers, seeded sampling independent of batching,
log-probs equal to a fresh forward pass, and load_weights from checkpoint-format names."""
from __future__ import annotations

import pytest
import torch

from megarl.rollout.base import RolloutRequest, SamplingParams
from megarl.rollout.hf import HFRolloutEngine

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]


def _requests(prompts=PROMPTS, step=0, offset=0):
    return [RolloutRequest(tuple(p), offset + i, step) for i, p in enumerate(prompts)]


def _reference(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _engine_from_checkpoint(model_dir, **kw) -> HFRolloutEngine:
    """Random weights from config.json, then the checkpoint streamed through load_weights."""
    from safetensors import safe_open

    engine = HFRolloutEngine.from_hf_dir(str(model_dir), **kw)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        engine.load_weights((name, f.get_tensor(name)) for name in f.keys())
    return engine


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "mixtral"])
def test_greedy_matches_transformers_generate_after_load_weights(tiny_models, family):
    # llama: tied embeddings; qwen3_moe / mixtral: per-expert checkpoint names into fused experts.
    ref = _reference(tiny_models[family])
    engine = _engine_from_checkpoint(tiny_models[family], max_batch_rows=3)
    eos = ref.generation_config.eos_token_id
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    results = engine.generate(_requests(), SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=eos))
    for prompt, res in zip(PROMPTS, results):
        out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
                           max_new_tokens=10, pad_token_id=0)
        assert res.response_token_ids == out[0, len(prompt):].tolist()
        assert res.finish_reason == ("stop" if res.response_token_ids[-1] in eos else "length")


def test_seeded_samples_do_not_depend_on_batching(tiny_models):
    engine = HFRolloutEngine(_reference(tiny_models["qwen3"]), max_batch_rows=64)
    sampling = SamplingParams(n=3, temperature=0.9, top_p=0.95, top_k=50, max_new_tokens=8, seed=7)
    reqs = _requests(step=2)
    together = engine.generate(reqs, sampling)
    split = engine.generate(reqs[:1], sampling) + engine.generate(reqs[1:], sampling)  # two "rollout DP ranks"
    engine.max_batch_rows = 1
    one_by_one = engine.generate(reqs, sampling)
    for a, b, c in zip(together, split, one_by_one):
        assert a.response_token_ids == b.response_token_ids == c.response_token_ids
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(c.logprobs), atol=1e-5, rtol=0)
    # the n samples of a prompt differ (distinct seeds), and the next step samples differently
    assert len({tuple(r.response_token_ids) for r in together[:3]}) > 1
    next_step = engine.generate(_requests(step=3), sampling)
    assert [r.response_token_ids for r in next_step] != [r.response_token_ids for r in together]


def test_logprobs_equal_a_fresh_forward_pass(tiny_models):
    model = _reference(tiny_models["qwen2"])
    engine = HFRolloutEngine(model)
    T = 0.7
    results = engine.generate(_requests(), SamplingParams(n=2, temperature=T, top_k=20, max_new_tokens=6, seed=1))
    for res in results:
        prompt = list(PROMPTS[res.prompt_index])
        seq = torch.tensor([prompt + res.response_token_ids])
        with torch.no_grad():
            logits = model(seq).logits[0, len(prompt) - 1:-1].float() / T
        scaled = torch.log_softmax(logits, -1).gather(-1, torch.tensor(res.response_token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(res.scaled_logprobs), scaled, atol=1e-5, rtol=0)
        # top-k renormalises over fewer tokens: the sampled token is at least as likely
        assert all(p >= s - 1e-6 for p, s in zip(res.logprobs, res.scaled_logprobs))
        top20 = torch.topk(logits, 20, dim=-1).indices
        assert all(tok in top20[j].tolist() for j, tok in enumerate(res.response_token_ids))


def test_stop_token_ends_the_response(tiny_models):
    engine = HFRolloutEngine(_reference(tiny_models["llama"]))
    greedy = engine.generate(_requests(PROMPTS[:1]), SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    stop = greedy.response_token_ids[2]
    first = greedy.response_token_ids.index(stop)
    res = engine.generate(_requests(PROMPTS[:1]), SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(stop,)))[0]
    assert res.response_token_ids == greedy.response_token_ids[:first + 1]
    assert res.finish_reason == "stop" and len(res.logprobs) == first + 1


def test_load_weights_reports_unknown_missing_and_misshapen(tiny_models):
    engine = HFRolloutEngine.from_hf_dir(str(tiny_models["qwen3_moe"]))
    good = dict(engine.model.state_dict())
    embed = good["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match=r"unknown weight 'model.embed_tokenz.weight' \(nearest: 'model.embed_tokens.weight'\)"):
        engine.load_weights([("model.embed_tokenz.weight", embed)], strict=False)
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("model.embed_tokens.weight", embed[:-1])], strict=False)
    with pytest.raises(ValueError, match="not \\(fully\\) written"):
        engine.load_weights([("model.embed_tokens.weight", embed)])
    with pytest.raises(ValueError, match="expert 9 out of range"):
        engine.load_weights([("model.layers.0.mlp.experts.9.up_proj.weight", torch.zeros(64, 64))], strict=False)


def test_release_and_resume_are_safe_on_cpu(tiny_models):
    engine = HFRolloutEngine(_reference(tiny_models["llama"]))
    before = engine.generate(_requests(PROMPTS[:1]), SamplingParams(temperature=0.0, max_new_tokens=4))
    engine.release_memory()
    with pytest.raises(RuntimeError, match="release_memory"):
        engine.generate(_requests(PROMPTS[:1]), SamplingParams(temperature=0.0, max_new_tokens=4))
    engine.resume_memory()
    after = engine.generate(_requests(PROMPTS[:1]), SamplingParams(temperature=0.0, max_new_tokens=4))
    assert before[0].response_token_ids == after[0].response_token_ids


def test_ignore_eos_runs_every_response_to_the_limit(tiny_models):
    """rollout.ignore_eos takes eos out of the stop tokens the trainer gives every engine: the token
    that ends a greedy response with eos stopping it no longer ends it."""
    from megarl.config.schema import RolloutConfig
    from megarl.rollout.base import stop_token_ids

    engine = HFRolloutEngine(_reference(tiny_models["qwen3"]))
    reqs = [RolloutRequest((5, 6, 7), 0)]
    first = engine.generate(reqs, SamplingParams(temperature=0.0, max_new_tokens=6))[0].response_token_ids[0]
    # Let that first greedy token play eos: with eos stopping, the response is that one token.
    assert stop_token_ids(RolloutConfig(stop_token_ids=[3]), eos_token_id=first) == (3, first)
    assert stop_token_ids(RolloutConfig(stop_token_ids=[3], ignore_eos=True), eos_token_id=first) == (3,)
    stopped, free = (engine.generate(reqs, SamplingParams(temperature=0.0, max_new_tokens=6,
                                                          stop_token_ids=stop_token_ids(RolloutConfig(ignore_eos=ignore), first)))[0]
                     for ignore in (False, True))
    assert stopped.response_token_ids == [first]
    assert len(free.response_token_ids) == 6 and free.response_token_ids[0] == first
