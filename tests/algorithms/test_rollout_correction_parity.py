"""The off-policy corrections equal the formulas their authors publish, re-stated here
independently in plain numpy loops (one token at a time) on random float64 inputs:

- TIS (Yao et al. 2025; verl `rollout_is: token`, slime `vanilla_tis_function`):
  w_t = min(exp(old - rollout), C), loss = token-mean of w_t * PPO-clip.
- MIS as verl's preset `decoupled_seq_is_rs` (verl docs/algo/rollout_corr.md): sequence IS weight
  min(prod_t r_t, 2.0), sequences with prod_t r_t outside [0.5, 2.0] rejected through the response
  mask (rejected tokens leave the token-mean's denominator).
- IcePop (Ling team 2025, Ring-1T): M(k) = k if 0.5 <= k <= 5 else 0 multiplies PPO-clip; the
  token-mean runs over all response tokens.
- AReaL's decoupled PPO (`ppo_actor_loss_fn`, docs/en/algorithms/async.md): behaviour weight
  exp(prox - behav), zero above `behav_imp_weight_cap`, times the PPO-clip (with dual clip) of
  pi_theta / pi_prox; sum over the loss mask / number of mask tokens.
"""
import math

import numpy as np
import pytest
import torch

from megarl.algorithms import compute_rollout_correction, policy_loss

F64 = torch.float64
EPS, DUAL = 0.2, 3.0


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 8, 6
    old = -3 * torch.rand(B, T, generator=g, dtype=F64)
    # sequence-level ratios spread around 1 so some sequences fall inside MIS's band and some outside
    rollout = old + 0.5 * torch.randn(B, T, generator=g, dtype=F64) * torch.linspace(0.05, 2.5, B, dtype=F64)[:, None]
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    return old, rollout, logp, adv, mask


def _ppo_token(logp, old, a):
    """One token's PPO-clip loss with dual clip (Schulman et al. 2017; Ye et al. 2020)."""
    ratio = math.exp(max(min(logp - old, 20.0), -20.0))
    loss = max(-a * ratio, -a * min(max(ratio, 1 - EPS), 1 + EPS))
    return min(loss, -a * DUAL) if a < 0 else loss


def _np(*ts):
    return [t.detach().numpy() for t in ts]


def oracle_tis(old, rollout, logp, adv, mask, C=2.0):
    old, rollout, logp, adv, mask = _np(old, rollout, logp, adv, mask)
    total, n = 0.0, 0
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            if mask[i, t]:
                w = min(math.exp(old[i, t] - rollout[i, t]), C)
                total += w * _ppo_token(logp[i, t], old[i, t], adv[i, t])
                n += 1
    return total / n


def oracle_verl_seq_is_rs(old, rollout, logp, adv, mask, C=2.0, lo=0.5, hi=2.0):
    old, rollout, logp, adv, mask = _np(old, rollout, logp, adv, mask)
    total, n = 0.0, 0
    for i in range(old.shape[0]):
        rho = math.exp(sum(old[i, t] - rollout[i, t] for t in range(old.shape[1]) if mask[i, t]))
        if not lo <= rho <= hi:
            continue
        for t in range(old.shape[1]):
            if mask[i, t]:
                total += min(rho, C) * _ppo_token(logp[i, t], old[i, t], adv[i, t])
                n += 1
    return total / max(n, 1)


def oracle_icepop(old, rollout, logp, adv, mask, alpha=0.5, beta=5.0):
    old, rollout, logp, adv, mask = _np(old, rollout, logp, adv, mask)
    total, n = 0.0, 0
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            if mask[i, t]:
                k = math.exp(old[i, t] - rollout[i, t])
                total += (k if alpha <= k <= beta else 0.0) * _ppo_token(logp[i, t], old[i, t], adv[i, t])
                n += 1
    return total / n


def oracle_areal_decoupled(prox, behav, logp, adv, mask, cap=None):
    prox, behav, logp, adv, mask = _np(prox, behav, logp, adv, mask)
    total, n = 0.0, int(np.count_nonzero(mask))
    for i in range(prox.shape[0]):
        for t in range(prox.shape[1]):
            if mask[i, t]:
                w = math.exp(prox[i, t] - behav[i, t])
                if cap is not None and w > cap:
                    w = 0.0
                total += w * _ppo_token(logp[i, t], prox[i, t], adv[i, t])
    return total / n


def _ours(old, rollout, logp, adv, mask, mode, **kw):
    corr = compute_rollout_correction(old, rollout, mask, mode, **kw)
    loss, _ = policy_loss(logp, old, adv, corr.loss_mask, clip_ratio_low=EPS, clip_ratio_high=EPS, clip_ratio_c=DUAL,
                          rollout_is_weights=corr.weights)
    return float(loss), corr


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tis_matches_the_published_formula(seed):
    old, rollout, logp, adv, mask = _inputs(seed)
    ours, corr = _ours(old, rollout, logp, adv, mask, "tis", rollout_is_threshold=2.0)
    assert corr.clipped.any(), "the inputs must exercise the truncation"
    assert ours == pytest.approx(oracle_tis(old, rollout, logp, adv, mask), abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mis_matches_verls_sequence_is_with_sequence_rejection(seed):
    old, rollout, logp, adv, mask = _inputs(seed)
    ours, corr = _ours(old, rollout, logp, adv, mask, "mis", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5)
    rejected = corr.masked.any(-1)
    assert rejected.any() and not rejected.all(), "the inputs must reject some sequences and keep others"
    assert ours == pytest.approx(oracle_verl_seq_is_rs(old, rollout, logp, adv, mask), abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_icepop_matches_the_papers_objective(seed):
    old, rollout, logp, adv, mask = _inputs(seed)
    ours, corr = _ours(old, rollout, logp, adv, mask, "icepop")
    assert corr.masked.any(), "the inputs must exercise the mask"
    assert ours == pytest.approx(oracle_icepop(old, rollout, logp, adv, mask), abs=1e-12)


@pytest.mark.parametrize("seed,cap", [(0, None), (1, None), (2, 1.5)])
def test_decoupled_matches_areals_loss(seed, cap):
    prox, behav, logp, adv, mask = _inputs(seed)
    ours, corr = _ours(prox, behav, logp, adv, mask, "decoupled", behav_imp_weight_cap=cap)
    assert cap is None or corr.masked.any()
    assert ours == pytest.approx(oracle_areal_decoupled(prox, behav, logp, adv, mask, cap), abs=1e-12)
