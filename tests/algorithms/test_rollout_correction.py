"""Hand-worked values of each off-policy correction mode (megarl/algorithms/rollout_correction.py).

Two sequences whose token ratios r = pi_old / pi_rollout are chosen exactly:
    sequence 0: r = [4, 0.5, 1]       prod 2
    sequence 1: r = [0.25, 1.5, pad]  prod 0.375
Padding holds NaN: nothing under a 0 of the mask may leak into weights or metrics.
"""
import math

import pytest
import torch

from megarl.algorithms import compute_rollout_correction, policy_loss
from megarl.algorithms.rollout_correction import SAFETY_LOG_BOUND
from megarl.algorithms.rollout_correction import metrics

F64 = torch.float64
NAN = float("nan")


def _batch():
    r = torch.tensor([[4.0, 0.5, 1.0], [0.25, 1.5, 1.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
    rollout = torch.zeros_like(r)  # old - rollout = log r exactly, so ratios on a band edge stay on it
    old = rollout + r.log()
    old[1, 2] = NAN
    rollout[1, 2] = NAN
    return old, rollout, mask


def _w(corr):
    return [x for row in corr.weights.tolist() for x in row]  # flat: pytest.approx takes no nesting


def test_none_has_no_weights_and_keeps_the_mask():
    old, rollout, mask = _batch()
    corr = compute_rollout_correction(old, rollout, mask, "none")
    assert corr.weights is None and corr.loss_mask is mask
    m = metrics(corr, old, rollout, mask)
    assert m["rollout_corr/kl"] == pytest.approx(-math.log(4 * 0.5 * 1 * 0.25 * 1.5) / 5)
    k3 = sum(x - 1 - math.log(x) for x in (4, 0.5, 1, 0.25, 1.5)) / 5
    assert m["rollout_corr/k3_kl"] == pytest.approx(k3)
    assert set(m) == {"rollout_corr/kl", "rollout_corr/k3_kl"}


def test_tis_token_truncates_from_above_only():
    old, rollout, mask = _batch()
    corr = compute_rollout_correction(old, rollout, mask, "tis", rollout_is_threshold=2.0)
    assert _w(corr) == pytest.approx([2.0, 0.5, 1.0, 0.25, 1.5, 0.0])
    assert corr.clipped.tolist() == [[True, False, False], [False, False, False]]
    assert corr.loss_mask is mask and not corr.masked.any()
    m = metrics(corr, old, rollout, mask)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(5.25 / 5)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(2.0) and m["rollout_corr/rollout_is_min"] == pytest.approx(0.25)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    # ESS = mean(w)^2 / mean(w^2) = 1.05^2 / ((4 + 0.25 + 1 + 0.0625 + 2.25) / 5)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.05**2 / (7.5625 / 5))


def test_tis_sequence_uses_the_product_ratio():
    old, rollout, mask = _batch()
    corr = compute_rollout_correction(old, rollout, mask, "tis", rollout_is="sequence", rollout_is_threshold=1.5)
    assert _w(corr) == pytest.approx([1.5, 1.5, 1.5, 0.375, 0.375, 0.0])
    assert corr.clipped.tolist() == [[True, True, True], [False, False, False]]


def test_mis_rejects_sequences_outside_the_band_and_removes_them_from_the_loss_mask():
    old, rollout, mask = _batch()
    corr = compute_rollout_correction(old, rollout, mask, "mis", rollout_rs_threshold=2.0)  # lower = 1/2
    assert _w(corr) == pytest.approx([2.0, 2.0, 2.0, 0.0, 0.0, 0.0])  # rho = 2 is inside (bounds inclusive)
    assert corr.loss_mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    assert corr.masked.tolist() == [[False, False, False], [True, True, False]]
    m = metrics(corr, old, rollout, mask)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(2.0)  # over the tokens the loss counts
    # an explicit lower bound below 0.375 keeps both sequences
    corr = compute_rollout_correction(old, rollout, mask, "mis", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.3)
    assert _w(corr) == pytest.approx([2.0, 2.0, 2.0, 0.375, 0.375, 0.0])


def test_icepop_zeroes_tokens_outside_half_to_five_and_keeps_the_denominator():
    old, rollout, mask = _batch()
    corr = compute_rollout_correction(old, rollout, mask, "icepop")
    assert _w(corr) == pytest.approx([4.0, 0.5, 1.0, 0.0, 1.5, 0.0])
    assert corr.loss_mask is mask
    m = metrics(corr, old, rollout, mask)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    assert m["rollout_corr/rollout_is_min"] == 0.0 and m["rollout_corr/rollout_is_max"] == pytest.approx(4.0)


def test_decoupled_weight_is_pi_prox_over_pi_behav_with_an_optional_cap():
    old, rollout, mask = _batch()
    assert _w(compute_rollout_correction(old, rollout, mask, "decoupled")) == pytest.approx([4.0, 0.5, 1.0, 0.25, 1.5, 0.0])
    corr = compute_rollout_correction(old, rollout, mask, "decoupled", behav_imp_weight_cap=3.0)
    assert _w(corr) == pytest.approx([0.0, 0.5, 1.0, 0.25, 1.5, 0.0])
    assert corr.masked.tolist() == [[True, False, False], [False, False, False]]


def test_decoupled_loss_hand_worked():
    """Two tokens, clip 0.2, token-mean:
    token 0: A = +1, rho = pi_theta / pi_prox = 1.5 -> max(-1.5, -1.2) = -1.2, weight 0.5 -> -0.6
    token 1: A = -1, rho = 0.5 -> max(0.5, 0.8) = 0.8 (< dual clip 3), weight 2 -> 1.6
    loss = (-0.6 + 1.6) / 2 = 0.5; both tokens clipped, so no gradient."""
    behav = torch.log(torch.tensor([[0.4, 0.1]], dtype=F64))
    prox = torch.log(torch.tensor([[0.2, 0.2]], dtype=F64))  # weights 0.5 and 2
    logp = (prox + torch.log(torch.tensor([[1.5, 0.5]], dtype=F64))).requires_grad_()
    mask = torch.ones(1, 2, dtype=F64)
    corr = compute_rollout_correction(prox, behav, mask, "decoupled")
    loss, _ = policy_loss(logp, prox, torch.tensor([[1.0, -1.0]], dtype=F64), mask, rollout_is_weights=corr.weights)
    assert float(loss.detach()) == pytest.approx(0.5)
    loss.backward()
    assert logp.grad.abs().max() == 0


def test_decoupled_at_k0_with_agreeing_engine_is_plain_ppo():
    """Synchronous and an engine that agrees with the trainer: behaviour = proximal, weights 1."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g, dtype=F64)
    logp = old + 0.3 * torch.randn(3, 5, generator=g, dtype=F64)
    adv, mask = torch.randn(3, 5, generator=g, dtype=F64), (torch.rand(3, 5, generator=g) > 0.3).to(F64)
    corr = compute_rollout_correction(old, old.clone(), mask, "decoupled")
    assert torch.equal(corr.weights, mask)
    ours, _ = policy_loss(logp, old, adv, mask, rollout_is_weights=corr.weights)
    plain, _ = policy_loss(logp, old, adv, mask)
    assert float(ours) == pytest.approx(float(plain), abs=1e-12)


def test_safety_bound_keeps_a_stale_token_finite():
    old = torch.tensor([[0.0]], dtype=F64)
    rollout = torch.tensor([[-1000.0]], dtype=F64)
    corr = compute_rollout_correction(old, rollout, torch.ones(1, 1, dtype=F64), "decoupled")
    assert float(corr.weights) == pytest.approx(math.exp(SAFETY_LOG_BOUND))


def test_all_rejected_batch_reports_zeros_not_infinities():
    old, rollout, mask = _batch()
    corr = compute_rollout_correction(old, rollout, mask, "mis", rollout_rs_threshold=1.01)
    m = metrics(corr, old, rollout, mask)
    assert m["rollout_corr/rollout_is_max"] == 0.0 and m["rollout_corr/rollout_is_min"] == 0.0
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0


def test_bad_mode_names_the_valid_ones():
    old, rollout, mask = _batch()
    with pytest.raises(ValueError, match="tis, mis, icepop, decoupled"):
        compute_rollout_correction(old, rollout, mask, "bogus")
