"""On-policy distillation's reverse-KL terms (megarl.algorithms.distill, megarl.step.distill), hand-worked.

Two responses, R = 4, coef 0.1:
    logp          [-1.0, -2.0, -0.5, *]    [-0.2, *, -3.0, 0.0]
    teacher_logp  [-0.5, -2.5, -0.5, *]    [-1.2, *, -1.0, -7.0]
    mask          [ 1,    1,    1,   0]    [ 1,   0,  1,   0  ]     (row 1: an environment token at 1)
    rkl = logp - teacher_logp on the mask: [-0.5, 0.5, 0, 0]  [1.0, 0, -2.0, 0]
(* = garbage a forward may leave off the mask: -inf / nan.)
"""
from __future__ import annotations

import math

import pytest
import torch

from megarl import algorithms as A
from megarl.config.schema import DistillConfig
from megarl.step.distill import LossDistillation, RewardDistillation

INF, NAN = math.inf, math.nan
LOGP = torch.tensor([[-1.0, -2.0, -0.5, -INF], [-0.2, NAN, -3.0, 0.0]])
TEACHER = torch.tensor([[-0.5, -2.5, -0.5, NAN], [-1.2, -INF, -1.0, -7.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
RKL = torch.tensor([[-0.5, 0.5, 0.0, 0.0], [1.0, 0.0, -2.0, 0.0]])


def test_reverse_kl_per_token_is_zero_off_the_mask_even_over_garbage():
    torch.testing.assert_close(A.reverse_kl_per_token(LOGP, TEACHER, MASK), RKL, rtol=0, atol=1e-7)


def test_reward_term_adds_coef_times_teacher_minus_policy_on_policy_tokens_only():
    # the task score on each response's last policy token: 1.0 at [0, 2], 0.5 at [1, 2]
    token_scores = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.5, 0.0]])
    rewards = A.distill_token_rewards(token_scores, LOGP, TEACHER, MASK, coef=0.1)
    # row 0: 0 - 0.1 * -0.5 = 0.05, 0 - 0.1 * 0.5 = -0.05, 1.0 - 0 = 1.0; row 1: -0.1, (hole) 0, 0.5 + 0.2 = 0.7
    expected = torch.tensor([[0.05, -0.05, 1.0, 0.0], [-0.1, 0.0, 0.7, 0.0]])
    torch.testing.assert_close(rewards, expected, rtol=0, atol=1e-7)
    # summed per response, for GRPO / RLOO / ReMax: -0.1 * (-0.5 + 0.5 + 0) = 0, -0.1 * (1 - 2) = 0.1
    torch.testing.assert_close(A.distill_sequence_rewards(LOGP, TEACHER, MASK, coef=0.1), torch.tensor([0.0, 0.1]),
                               rtol=0, atol=1e-7)


def test_reward_mode_shapes_token_rewards_and_the_scores_estimators_read():
    term = RewardDistillation(DistillConfig(teacher_path="t", coef=0.1), teacher=None, global_batch=None)
    token_scores = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.5, 0.0]])
    rewards, scores = term.shape_rewards(token_scores, torch.tensor([1.0, 0.5]), LOGP, TEACHER, MASK)
    torch.testing.assert_close(rewards, torch.tensor([[0.05, -0.05, 1.0, 0.0], [-0.1, 0.0, 0.7, 0.0]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.6]), rtol=0, atol=1e-7)
    assert term.loss(LOGP, TEACHER, MASK, "token-mean") is None and not term.in_loss
    # the loss mode leaves rewards and scores alone
    loss_term = LossDistillation(DistillConfig(teacher_path="t", coef=0.1, mode="loss"), teacher=None, global_batch=None)
    same = loss_term.shape_rewards(token_scores, torch.tensor([1.0, 0.5]), LOGP, TEACHER, MASK)
    assert same[0] is token_scores and loss_term.in_loss


@pytest.mark.parametrize("mode, totals, expected", [
    # token-mean over the 5 policy tokens: (-0.5 + 0.5 + 0 + 1 - 2) / 5
    ("token-mean", {}, -0.2),
    # the same micro-batch as part of a global batch of 10 tokens
    ("token-mean", {"global_tokens": 10}, -0.1),
    # seq-mean-token-mean: (0 / 3 + (-1) / 2) / 2
    ("seq-mean-token-mean", {}, -0.25),
])
def test_loss_value_is_the_reverse_kl_estimate_aggregated(mode, totals, expected):
    logp = LOGP.clone().requires_grad_(True)
    loss = A.distill_loss(logp, TEACHER, MASK, mode, **totals)
    assert loss.item() == pytest.approx(expected, abs=1e-7)


def test_loss_gradient_is_k2s_which_the_sampled_tokens_weight_by_their_log_ratio():
    """d/dlogp of the token-mean loss = (logp - teacher_logp) * mask / 5: the per-token reverse KL's
    gradient estimate (k1's own gradient, mask / 5 everywhere, would be zero in expectation)."""
    logp = torch.where(MASK.bool(), LOGP, torch.zeros(())).requires_grad_(True)  # a real forward: finite
    A.distill_loss(logp, TEACHER, MASK, "token-mean").backward()
    torch.testing.assert_close(logp.grad, RKL / 5, rtol=0, atol=1e-7)
    # through LossDistillation, as the actor's loss calls it
    logp.grad = None
    term = LossDistillation(DistillConfig(teacher_path="t", coef=0.1, mode="loss"), teacher=None, global_batch=None)
    term.loss(logp, TEACHER, MASK, "token-mean", global_tokens=5).backward()
    torch.testing.assert_close(logp.grad, RKL / 5, rtol=0, atol=1e-7)
