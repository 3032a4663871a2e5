"""Logit processing (temperature, top-k, top-p) and per-row seeded sampling, hand-worked."""
from __future__ import annotations

import math

import torch

from megarl.rollout.sampling import process_logits, sample_rows


def test_greedy_is_unscaled_log_softmax():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    processed, scaled = process_logits(logits, temperature=0.0, top_k=0, top_p=1.0)
    # softmax([0, log 3]) = [1/4, 3/4]
    assert torch.allclose(processed, torch.log(torch.tensor([[0.25, 0.75]])))
    assert torch.equal(processed, scaled)
    assert sample_rows(processed, [None], greedy=True).tolist() == [1]


def test_temperature_scales_both():
    logits = torch.tensor([[0.0, 2 * math.log(3.0)]])
    processed, scaled = process_logits(logits, temperature=2.0, top_k=0, top_p=1.0)
    # logits / 2 = [0, log 3] -> probs [1/4, 3/4]; no truncation so processed == scaled
    assert torch.allclose(scaled.exp(), torch.tensor([[0.25, 0.75]]))
    assert torch.equal(processed, scaled)


def test_top_k_renormalises_processed_but_not_scaled():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    processed, scaled = process_logits(logits, temperature=1.0, top_k=2, top_p=1.0)
    # keep 0.3 and 0.4 -> [0, 0, 3/7, 4/7]
    assert torch.allclose(processed.exp(), torch.tensor([[0.0, 0.0, 3 / 7, 4 / 7]]), atol=1e-6)
    assert torch.allclose(scaled.exp(), torch.tensor([[0.1, 0.2, 0.3, 0.4]]), atol=1e-6)


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    processed, _ = process_logits(logits, temperature=1.0, top_k=0, top_p=0.6)
    # ascending cumsum [0.1, 0.3, 0.6, 1.0]; drop where cumsum <= 1 - 0.6 = 0.4 -> drop 0.1, 0.2
    assert torch.allclose(processed.exp(), torch.tensor([[0.0, 0.0, 3 / 7, 4 / 7]]), atol=1e-6)
    processed, _ = process_logits(logits, temperature=1.0, top_k=0, top_p=0.01)
    assert torch.allclose(processed.exp(), torch.tensor([[0.0, 0.0, 0.0, 1.0]]))  # the top token always stays


def test_rows_sample_independently_of_their_batch():
    torch.manual_seed(0)
    lp = torch.log_softmax(torch.randn(3, 50), -1)
    together = sample_rows(lp, [torch.Generator().manual_seed(s) for s in (1, 2, 3)], greedy=False)
    alone = [sample_rows(lp[i:i + 1], [torch.Generator().manual_seed(s)], greedy=False).item() for i, s in enumerate((1, 2, 3))]
    assert together.tolist() == alone
    # a finished row (generator None) consumes nothing and gets token 0
    mixed = sample_rows(lp, [torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(3)], greedy=False)
    assert mixed.tolist() == [alone[0], 0, alone[2]]


def test_zero_probability_tokens_are_never_sampled():
    lp = torch.log(torch.tensor([[0.0, 0.5, 0.0, 0.5]]))
    seen = {sample_rows(lp, [torch.Generator().manual_seed(s)], greedy=False).item() for s in range(200)}
    assert seen == {1, 3}
