"""The one-cumsum sampler picks exactly the tokens the two-cumsum sampler picked, for the same seeds."""
from __future__ import annotations

import pytest
import torch

from megarl.rollout.sampling import inverse_cdf, process_logits, sample_rows


def two_cumsum_sampler(processed_logprobs, generators):
    """The sampler before this change (a second cumulative sum over the vocabulary per step)."""
    u = torch.zeros(len(generators), 1, dtype=torch.float64)
    for i, g in enumerate(generators):
        if g is not None:
            u[i, 0] = torch.rand((), generator=g, dtype=torch.float64)
    probs = processed_logprobs.double().exp()
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    last_positive = (probs > 0).cumsum(dim=-1).argmax(dim=-1)
    idx = torch.minimum(idx, last_positive)
    for i, g in enumerate(generators):
        if g is None:
            idx[i] = 0
    return idx


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (20, 1.0), (0, 0.8), (20, 0.9)])
def test_same_tokens_as_the_two_cumsum_sampler(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 997) * 3
    processed, _ = process_logits(logits, temperature=0.7, top_k=top_k, top_p=top_p)
    for step in range(50):
        seeds = [1000 * step + r for r in range(6)]
        live = [None if (r + step) % 5 == 0 else s for r, s in enumerate(seeds)]  # some finished rows
        got = sample_rows(processed, [torch.Generator().manual_seed(s) if s is not None else None for s in live], greedy=False)
        want = two_cumsum_sampler(processed, [torch.Generator().manual_seed(s) if s is not None else None for s in live])
        assert got.tolist() == want.tolist()


def test_a_uniform_rounding_to_the_total_takes_the_last_positive_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0, 0.0]], dtype=torch.float64)
    # u = 1: past the end of every cdf; the last token of positive probability is 3 in both rows.
    assert inverse_cdf(probs, torch.ones(2, 1, dtype=torch.float64)).tolist() == [3, 3]
    # Hand-worked: cdf row 0 = [0, .5, .5, 1, 1, 1]; u = 0.5 -> first cdf > 0.5 is index 3; u = 0.49 -> 1.
    assert inverse_cdf(probs, torch.tensor([[0.5], [0.49]], dtype=torch.float64)).tolist() == [3, 1]
