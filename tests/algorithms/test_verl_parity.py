"""megarl's RL math equals verl's definitions on random float64 inputs (to 1e-6 as the issue asks;
in practice to ~1e-12).

The `verl_*` functions below are an independent re-statement of verl's formulas as read from
    verl-project/verl  verl/trainer/ppo/core_algos.py   at 018f23b5f83a13340421349e40ec42530739b23a
    verl-project/verl  verl/utils/torch_functional.py   at 0db13434d04637f539356a9c43209387ed3894a4
kept in verl's own arithmetic (per-sample loops, masked_mean's +1e-8, np.clip) so they serve as
an oracle for parity only. Intentional differences are compared in their documented form:
megarl's GAE does not whiten (verl's = masked_whiten(ours)), and its agg_loss with totals returns
verl's value divided by dp_size (docs/algorithms.md).
"""
from collections import defaultdict

import numpy as np
import pytest
import torch

from megarl.algorithms import (
    AGG_MODES,
    AdaptiveKLController,
    agg_loss,
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
    gspo_policy_loss,
    kl_penalty,
    masked_whiten,
    policy_loss,
    value_loss,
)

F64 = torch.float64
TOL = dict(rtol=0, atol=1e-6)


# ------------------------------------------------- transcribed from verl, for parity only
def verl_masked_sum(values, mask, axis=None):
    valid = torch.where(mask.bool(), values, 0.0) * mask
    return valid.sum() if axis is None else valid.sum(axis)


def verl_masked_mean(values, mask, axis=None):
    return verl_masked_sum(values, mask, axis) / ((mask.sum() if axis is None else mask.sum(axis)) + 1e-8)


def verl_masked_whiten(values, mask, shift_mean=True):
    mean = verl_masked_mean(values, mask)
    var = verl_masked_mean((values - mean) ** 2, mask)
    n = mask.sum()
    var = var * n / (n - 1)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened + mean if not shift_mean else whitened


def verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    nextvalues, lastgaelam, rev = 0, 0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        rev.append(lastgaelam)
    advantages = torch.stack(rev[::-1], dim=1)
    returns = advantages + values
    return verl_masked_whiten(advantages, response_mask), returns


def _verl_groups(scores, index):
    id2score = defaultdict(list)
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    return id2score


def verl_grpo(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean, id2std = _verl_groups(scores, index), {}, {}
    for idx, group in id2score.items():
        if len(group) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            id2mean[idx], id2std[idx] = torch.mean(torch.stack(group)), torch.std(torch.stack(group))
    for i in range(scores.shape[0]):
        if norm_adv_by_std_in_grpo:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    return scores.unsqueeze(-1) * response_mask


def verl_rloo(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1)
    id2score = _verl_groups(scores, index)
    id2mean = {idx: (torch.tensor(0.0) if len(g) == 1 else torch.mean(torch.stack(g))) for idx, g in id2score.items()}
    for i in range(scores.shape[0]):
        n = len(id2score[index[i]])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
    return scores.unsqueeze(-1) * response_mask


def verl_reinforce_pp(token_level_rewards, response_mask, gamma):
    # verl 0.9 carries the running return across observation tokens the way its GAE carries
    # nextvalues / lastgaelam (verl <= 0.8 reset it to 0 there: `running_return * response_mask[:, t]`).
    returns = torch.zeros_like(token_level_rewards)
    running_return = 0
    for t in reversed(range(token_level_rewards.shape[1])):
        running_return_ = token_level_rewards[:, t] + gamma * running_return
        running_return = running_return_ * response_mask[:, t] + (1 - response_mask[:, t]) * running_return
        returns[:, t] = running_return
    return verl_masked_whiten(returns, response_mask) * response_mask, returns


def verl_remax(token_level_rewards, reward_baselines, response_mask):
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - reward_baselines.unsqueeze(-1) * response_mask


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                  loss_scale_factor=None):
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        return verl_masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss /= loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return loss
    assert loss_agg_mode == "seq-mean-token-mean"
    seq_mask = torch.sum(loss_mask, dim=-1)
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
    seq_mask = (seq_mask > 0).float()
    if global_batch_size is None:
        global_batch_size = seq_mask.sum()
    return verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size


def verl_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, cliprange_low,
                             cliprange_high, clip_ratio_c):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = verl_masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(),
                                         response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac.item(), "actor/ppo_kl": ppo_kl.item(),
                     "actor/pg_clipfrac_lower": pg_clipfrac_lower.item()}


def verl_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high):
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    seq_importance_ratio = torch.exp(torch.clamp(log_seq_importance_ratio, max=10.0))
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_loss = verl_agg_loss(pg_losses, response_mask, "seq-mean-token-mean")
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac.item(), "actor/ppo_kl": ppo_kl.item(),
                     "actor/pg_clipfrac_lower": 0.0}


def verl_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode):
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * verl_agg_loss(torch.max(vf_losses1, vf_losses2), response_mask, loss_agg_mode)
    return vf_loss, verl_masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)


def verl_kl_penalty(logprob, ref_logprob, kl_penalty):
    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    if base in ("kl", "k1"):
        forward = logprob - ref_logprob
    elif base == "abs":
        forward = (logprob - ref_logprob).abs()
    elif base in ("mse", "k2"):
        forward = 0.5 * (logprob - ref_logprob).square()
    else:
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        forward = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    if not kl_penalty.endswith("+") or kl_penalty in ("mse", "k2"):
        return forward
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + forward.detach()


class VerlAdaptiveKLController:
    def __init__(self, init_kl_coef, target_kl, horizon):
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl, n_steps):
        proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


# ------------------------------------------------- random inputs
def _batch(seed=0, batch=16, response_len=10):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, response_len + 1, (batch,), generator=g)
    mask = (torch.arange(response_len) < lengths.unsqueeze(-1)).to(F64)
    holes = torch.rand(batch, response_len, generator=g) < 0.15  # observation tokens inside responses
    mask[holes] = 0
    mask[3] = 0  # an all-masked row
    rnd = lambda scale=1.0: torch.randn(batch, response_len, generator=g, dtype=F64) * scale  # noqa: E731
    return {
        "mask": mask,
        "rewards": rnd(),
        "values": rnd(),
        "old_values": rnd(),
        "returns": rnd(),
        "advantages": rnd(),
        "logp": -rnd().abs() * 2,
        "old_logp": -rnd().abs() * 2,
        "group_ids": torch.randint(0, 7, (batch,), generator=g).tolist(),  # random sizes incl. groups of one
        "baselines": torch.randn(batch, generator=g, dtype=F64),
    }


@pytest.fixture(params=[0, 1, 2])
def b(request):
    return _batch(seed=request.param)


def test_advantages_match_verl(b):
    m = b["mask"]
    adv, ret = compute_gae(b["rewards"], b["values"], m, gamma=0.99, lam=0.95)
    verl_adv, verl_ret = verl_gae(b["rewards"], b["values"], m, 0.99, 0.95)
    torch.testing.assert_close(masked_whiten(adv, m), verl_adv, **TOL)
    torch.testing.assert_close(ret, verl_ret, **TOL)

    scores = b["rewards"].sum(-1)
    for norm in (True, False):
        ours = compute_grpo_advantages(scores, b["group_ids"], m, norm_by_std=norm)
        theirs = verl_grpo(b["rewards"].clone(), m, b["group_ids"], norm_adv_by_std_in_grpo=norm)
        torch.testing.assert_close(ours, theirs, **TOL)
    torch.testing.assert_close(compute_rloo_advantages(scores, b["group_ids"], m),
                               verl_rloo(b["rewards"].clone(), m, b["group_ids"]), **TOL)

    adv, ret = compute_reinforce_pp_advantages(b["rewards"], m, gamma=0.9)
    verl_adv, verl_ret = verl_reinforce_pp(b["rewards"], m, 0.9)
    torch.testing.assert_close(adv, verl_adv, **TOL)
    torch.testing.assert_close(ret, verl_ret, **TOL)

    torch.testing.assert_close(compute_remax_advantages(b["rewards"], b["baselines"], m),
                               verl_remax(b["rewards"], b["baselines"], m), **TOL)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_agg_loss_matches_verl_and_totals_are_verl_over_dp_size(b, agg):
    loss_mat, m = b["advantages"], b["mask"]
    torch.testing.assert_close(agg_loss(loss_mat, m, agg), verl_agg_loss(loss_mat, m, agg), **TOL)
    # verl pre-multiplies by dp_size because DDP averages gradients; megarl's contributions are summed.
    totals = dict(global_tokens=57, global_seqs=11, loss_scale_factor=10)
    verl_totals = dict(batch_num_tokens=57, global_batch_size=11, loss_scale_factor=10)
    torch.testing.assert_close(agg_loss(loss_mat, m, agg, **totals) * 4,
                               verl_agg_loss(loss_mat, m, agg, dp_size=4, **verl_totals), **TOL)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_policy_and_value_losses_match_verl(b, agg):
    m = b["mask"]
    logp = b["logp"].clone().requires_grad_(True)
    verl_logp = b["logp"].clone().requires_grad_(True)
    # advantages scaled by 3 and ratios up to e^4 so that clip, clip-higher and dual-clip branches all occur
    adv = b["advantages"] * 3
    loss, metrics = policy_loss(logp, b["old_logp"], adv, m, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                clip_ratio_c=3.0, agg=agg)
    verl_loss, verl_metrics = verl_policy_loss_vanilla(b["old_logp"], verl_logp, adv, m, agg, 0.2, 0.28, 3.0)
    assert verl_metrics["actor/pg_clipfrac_lower"] > 0 and verl_metrics["actor/pg_clipfrac"] > 0
    torch.testing.assert_close(loss, verl_loss, **TOL)
    assert metrics == pytest.approx(verl_metrics, abs=1e-6)
    loss.backward()
    verl_loss.backward()
    torch.testing.assert_close(logp.grad, verl_logp.grad, **TOL)

    values = b["values"].clone().requires_grad_(True)
    verl_values = b["values"].clone().requires_grad_(True)
    vloss, vmetrics = value_loss(values, b["old_values"], b["returns"], m, clip_range=0.5, agg=agg)
    verl_vloss, verl_clipfrac = verl_value_loss(verl_values, b["returns"], b["old_values"], m, 0.5, agg)
    torch.testing.assert_close(vloss, verl_vloss, **TOL)
    assert vmetrics["critic/vf_clipfrac"] == pytest.approx(verl_clipfrac.item(), abs=1e-6)
    vloss.backward()
    verl_vloss.backward()
    torch.testing.assert_close(values.grad, verl_values.grad, **TOL)


def test_gspo_matches_verl(b):
    m = b["mask"]
    logp = (b["old_logp"] + 0.05 * b["rewards"]).requires_grad_(True)
    verl_logp = logp.detach().clone().requires_grad_(True)
    loss, metrics = gspo_policy_loss(logp, b["old_logp"], b["advantages"], m, clip_ratio_low=0.01, clip_ratio_high=0.02)
    verl_loss, verl_metrics = verl_policy_loss_gspo(b["old_logp"], verl_logp, b["advantages"], m, 0.01, 0.02)
    torch.testing.assert_close(loss, verl_loss, **TOL)
    assert metrics == pytest.approx(verl_metrics, abs=1e-6)
    loss.backward()
    verl_loss.backward()
    torch.testing.assert_close(logp.grad, verl_logp.grad, **TOL)


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                                  "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"])
def test_kl_penalty_matches_verl(b, kind):
    ref_logp = b["old_logp"] * 8  # wide log-ratios so that k3's clamps are exercised
    logp = b["logp"].clone().requires_grad_(True)
    verl_logp = b["logp"].clone().requires_grad_(True)
    ours, theirs = kl_penalty(logp, ref_logp, kind), verl_kl_penalty(verl_logp, ref_logp, kind)
    torch.testing.assert_close(ours, theirs, **TOL)
    (ours * b["advantages"]).sum().backward()
    (theirs * b["advantages"]).sum().backward()
    torch.testing.assert_close(logp.grad, verl_logp.grad, **TOL)


def test_adaptive_kl_controller_trajectory_matches_verl():
    rng = np.random.default_rng(0)
    ours, theirs = AdaptiveKLController(0.1, target_kl=3.0, horizon=10000), VerlAdaptiveKLController(0.1, 3.0, 10000)
    for _ in range(200):
        kl, n = float(rng.uniform(0, 8)), int(rng.integers(1, 1024))
        ours.update(kl, n)
        theirs.update(kl, n)
        assert ours.value == pytest.approx(float(theirs.value), rel=1e-12)
