"""SamplingParams validation, the per-sample seed, request expansion and result padding."""
from __future__ import annotations

import pytest
import torch

from megarl.rollout import build_rollout_engine
from megarl.rollout.base import RolloutRequest, RolloutResult, SamplingParams, expand_samples, make_sample_seed, pad_results


def test_sample_seed_is_stable_and_distinct():
    # Pinned value: a change here changes every rollout of every run; bump it only on purpose.
    assert make_sample_seed(0, 0, 0, 0) == make_sample_seed(0, 0, 0, 0)
    assert make_sample_seed(1234, 7, 42, 3) == 103535934665683264
    seeds = {make_sample_seed(s, t, p, j) for s in (0, 1) for t in range(3) for p in range(20) for j in range(4)}
    assert len(seeds) == 2 * 3 * 20 * 4
    assert all(0 <= x < 2**63 for x in seeds)


def test_expand_samples_is_prompt_major_with_per_sample_seeds():
    reqs = [RolloutRequest((1, 2), prompt_index=10, step=3), RolloutRequest((3,), prompt_index=4, step=3)]
    specs = expand_samples(reqs, SamplingParams(n=2, seed=5))
    assert [(s.request.prompt_index, s.sample_index) for s in specs] == [(10, 0), (10, 1), (4, 0), (4, 1)]
    assert specs[1].seed == make_sample_seed(5, 3, 10, 1)


@pytest.mark.parametrize("kwargs", [dict(n=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                    dict(max_new_tokens=0)])
def test_sampling_params_reject_bad_values(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_empty_prompt_rejected():
    with pytest.raises(ValueError, match="no tokens"):
        RolloutRequest((), 0)


def test_pad_results():
    rs = [RolloutResult(0, 0, [5, 6, 7], [-0.1, -0.2, -0.3], "stop", [-1.0, -2.0, -3.0]), RolloutResult(0, 1, [8], [-0.5], "length")]
    b = pad_results(rs)
    assert b.token_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b.mask.tolist() == [[True, True, True], [True, False, False]]
    assert torch.allclose(b.logprobs, torch.tensor([[-0.1, -0.2, -0.3], [-0.5, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="scaled_logprobs"):
        pad_results(rs, use_scaled=True)


def test_factory_rejects_unknown_engine_and_hf_tp():
    with pytest.raises(ValueError, match="did you mean 'vllm'"):
        build_rollout_engine("vlm", "/nonexistent")
    with pytest.raises(ValueError, match=r"rollout.engine=hf runs one model per rank \(rollout.tp 1\), got rollout.tp=2"):
        build_rollout_engine("hf", "/nonexistent", tp=2)
