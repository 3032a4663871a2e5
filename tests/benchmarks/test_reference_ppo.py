"""benchmarks/reference_ppo.py is the yardstick of learning per sample: its GAE is checked by hand
and against megarl's independent implementation, so a comparison with it measures megarl."""
from __future__ import annotations

import pytest
import torch

from reference_ppo import gae, whiten

from megarl.algorithms import compute_gae


def test_gae_by_hand():
    # one response of 3 tokens (score 1 on the last), one of 2 then padding; gamma 1, lam 0.5
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    values = torch.tensor([[0.2, 0.4, 0.6], [0.1, 0.3, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # row 0: d2 = 1 - 0.6 = 0.4; d1 = 0 + 0.6 - 0.4 = 0.2, A1 = 0.2 + 0.5*0.4 = 0.4; d0 = 0.4 - 0.2 = 0.2, A0 = 0.2 + 0.5*0.4 = 0.4
    # row 1: d1 = 0.5 - 0.3 = 0.2; d0 = 0.3 - 0.1 = 0.2, A0 = 0.2 + 0.5*0.2 = 0.3; the padding is 0
    torch.testing.assert_close(adv, torch.tensor([[0.4, 0.4, 0.4], [0.3, 0.2, 0.0]]))
    torch.testing.assert_close(ret[mask.bool()], (adv + values)[mask.bool()])


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.95)])
def test_gae_equals_megarl_on_right_padded_responses(gamma, lam):
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.rand(6, 5, generator=g), torch.rand(6, 5, generator=g)
    mask = (torch.arange(5) < torch.tensor([5, 3, 1, 4, 2, 5])[:, None]).float()
    ours, _ = gae(rewards * mask, values * mask, mask, gamma, lam)
    theirs, _ = compute_gae(rewards * mask, values * mask, mask, gamma, lam)
    torch.testing.assert_close(ours, theirs * mask)


def test_whiten_over_valid_tokens():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = whiten(x, mask)
    # mean 2, unbiased std sqrt(2): (1 - 2) / sqrt(2), (3 - 2) / sqrt(2); the masked token 0
    torch.testing.assert_close(out, torch.tensor([[-(0.5 ** 0.5), 0.5 ** 0.5, 0.0]]), atol=1e-6, rtol=0)
