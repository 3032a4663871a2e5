"""Hand-worked values for the advantage estimators."""

import numpy as np
import pytest
import torch

from megarl.algorithms import (
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_returns,
    compute_remax_advantages,
    compute_rloo_advantages,
)

F64 = torch.float64


def t(rows):
    return torch.tensor(rows, dtype=F64)


def test_gae_gamma_lam_one_is_monte_carlo_minus_value():
    # gamma = lam = 1: A_t = (sum of future rewards) - V_t = 1 - V_t; returns = A + V = 1 everywhere.
    adv, ret = compute_gae(t([[0, 0, 1]]), t([[0.2, 0.4, 0.6]]), torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, t([[0.8, 0.6, 0.4]]))
    torch.testing.assert_close(ret, t([[1.0, 1.0, 1.0]]))


def test_gae_carries_value_and_advantage_across_a_masked_hole():
    # token 1 is an observation (hole), token 4 is padding; gamma = lam = 0.5 so gamma*lam = 0.25.
    # Rewards (9, 7) and values (100, 50) on masked tokens must be ignored.
    rewards = t([[0, 9, 0, 1, 7]])
    values = t([[1, 100, 2, 4, 50]])
    mask = torch.tensor([[1, 0, 1, 1, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # t=4 masked: A=0 (nothing after it)
    # t=3: delta = 1 + 0.5*0 - 4 = -3;            A = -3
    # t=2: delta = 0 + 0.5*4 - 2 = 0;             A = 0 + 0.25*(-3) = -0.75
    # t=1 masked: carries A = -0.75 and V_next = 2 (not 100)
    # t=0: delta = 0 + 0.5*2 - 1 = 0;             A = 0 + 0.25*(-0.75) = -0.1875
    torch.testing.assert_close(adv, t([[-0.1875, -0.75, -0.75, -3.0, 0.0]]))
    torch.testing.assert_close(ret, adv + values)  # [0.8125, 99.25, 1.25, 1, 50]


def test_gae_all_masked_row_has_zero_advantage():
    adv, ret = compute_gae(t([[1, 1, 1]]), t([[0.5, 0.5, 0.5]]), torch.zeros(1, 3), gamma=0.9, lam=0.9)
    torch.testing.assert_close(adv, torch.zeros(1, 3, dtype=F64))
    torch.testing.assert_close(ret, t([[0.5, 0.5, 0.5]]))


def test_gae_rejects_bad_gamma():
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(t([[0.0]]), t([[0.0]]), torch.ones(1, 1), gamma=1.5, lam=0.9)


# Groups (interleaved on purpose): 0 -> scores [1, 3, 5]; 1 -> [4] alone; 2 -> [7, 7].
SCORES = t([1, 4, 3, 7, 5, 7])
GROUPS = [0, 1, 0, 2, 0, 2]
# Row 1 has a hole, row 3 is all masked.
MASK = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1], [0, 0, 0], [1, 0, 0], [1, 1, 1]])


@pytest.mark.parametrize("group_ids", [GROUPS, torch.tensor(GROUPS), np.array(["a", "b", "a", "c", "a", "c"])])
def test_grpo(group_ids):
    eps = 1e-6
    adv = compute_grpo_advantages(SCORES, group_ids, MASK)
    # group 0: mean 3, unbiased std sqrt((4 + 0 + 4) / 2) = 2 -> (-2, 0, 2) / (2 + eps)
    # group 1 (alone): mean 0, std 1 -> 4 / (1 + eps)
    # group 2: std 0 -> 0 / (0 + eps) = 0
    per_seq = t([-2 / (2 + eps), 4 / (1 + eps), 0.0, 0.0, 2 / (2 + eps), 0.0])
    torch.testing.assert_close(adv, per_seq.unsqueeze(-1) * MASK)


def test_dr_grpo_does_not_divide_by_std():
    adv = compute_grpo_advantages(SCORES, GROUPS, MASK, norm_by_std=False)
    torch.testing.assert_close(adv, t([-2, 4, 0, 0, 2, 0]).unsqueeze(-1) * MASK)


def test_rloo():
    adv = compute_rloo_advantages(SCORES, GROUPS, MASK)
    # group 0: s_i - mean(others): 1 - (3+5)/2 = -3, 3 - 3 = 0, 5 - 2 = 3
    # group 1 alone: keeps its score 4; group 2: 7 - 7 = 0
    torch.testing.assert_close(adv, t([-3, 4, 0, 0, 3, 0]).unsqueeze(-1) * MASK)


def test_grpo_rejects_token_level_scores():
    with pytest.raises(ValueError, match=r"sum\(-1\)"):
        compute_grpo_advantages(torch.ones(2, 3), [0, 0], torch.ones(2, 3))


def test_reinforce_pp_returns_carry_across_masked_holes_and_whitening():
    gamma = 0.5
    rewards = t([[1, 0, 2, 5], [0, 4, 0, 8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])
    returns = compute_reinforce_pp_returns(rewards, mask, gamma)
    # row 0: t3 (padding) reward 5 ignored, carries 0; t2 2; t1 0 + 0.5*2 = 1; t0 1 + 0.5*1 = 1.5
    # row 1: t3 8; t2 0 + 0.5*8 = 4; t1 (hole) reward 4 ignored, 4 carried undiscounted; t0 0 + 0.5*4 = 2
    # (the old reset-at-holes definition gave t0 = 0: the first turn never saw the final reward)
    torch.testing.assert_close(returns, t([[1.5, 1, 2, 0], [2, 4, 4, 8]]))
    adv, ret = compute_reinforce_pp_advantages(rewards, mask, gamma)
    # valid returns {1.5, 1, 2, 2, 4, 8}: mean 18.5/6, squared deviations sum 33.208.., unbiased var / 5
    valid = t([1.5, 1, 2, 2, 4, 8])
    mean, var = valid.mean(), ((valid - valid.mean()) ** 2).sum() / 5
    assert abs(float(mean) - 18.5 / 6) < 1e-12
    expected = (returns - mean) / torch.sqrt(var + 1e-8) * mask
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, returns)


def test_reinforce_pp_ignores_nan_rewards_on_masked_tokens():
    returns = compute_reinforce_pp_returns(t([[1, float("nan"), 2]]), torch.tensor([[1, 0, 1]]), gamma=1.0)
    torch.testing.assert_close(returns, t([[3, 2, 2]]))


def test_remax():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = compute_remax_advantages(t([1.0, 0.0]), t([0.5, 0.5]), mask)
    # 1 - 0.5 = 0.5 and 0 - 0.5 = -0.5, broadcast over valid tokens
    torch.testing.assert_close(adv, t([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]]))
    # token-level form (verl's): return-to-go of [0, 1, 0] is [1, 1, 0], minus 0.5 on valid tokens
    adv_tok = compute_remax_advantages(t([[0, 1, 0], [0, 0, 0]]), t([0.5, 0.5]), mask)
    torch.testing.assert_close(adv_tok, t([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]]))
