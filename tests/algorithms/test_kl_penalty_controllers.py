"""Hand-worked values for the KL estimators, the KL-in-reward helper and the KL controllers."""
import math

import pytest
import torch

from megarl.algorithms import (
    KL_KINDS_ALL,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    full_kl_penalty,
    kl_penalty,
)

F64 = torch.float64
E = math.e
# logp - ref_logp = [1, -1]; r = ref_logp - logp = [-1, 1]
LOGP = torch.tensor([[-1.0, -2.0]], dtype=F64)
REF = torch.tensor([[-2.0, -1.0]], dtype=F64)


@pytest.mark.parametrize(
    "kinds, value, grad",
    [
        (("kl", "k1"), [1.0, -1.0], [1.0, 1.0]),
        (("abs",), [1.0, 1.0], [1.0, -1.0]),
        (("mse", "k2"), [0.5, 0.5], [1.0, -1.0]),  # 0.5 * d^2 -> gradient d
        # k3 = e^r - r - 1: e^-1 + 1 - 1 = 1/e and e - 1 - 1 = e - 2; d/dlogp = 1 - e^r
        (("low_var_kl", "k3"), [1 / E, E - 2], [1 - 1 / E, 1 - E]),
    ],
)
def test_estimators_value_and_gradient(kinds, value, grad):
    for kind in kinds:
        logp = LOGP.clone().requires_grad_(True)
        kl = kl_penalty(logp, REF, kind)
        kl.sum().backward()
        torch.testing.assert_close(kl.detach(), torch.tensor([value], dtype=F64))
        torch.testing.assert_close(logp.grad, torch.tensor([grad], dtype=F64))


@pytest.mark.parametrize("kind", ["kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"])
def test_straight_through_variants_have_named_value_and_k2_gradient(kind):
    logp = LOGP.clone().requires_grad_(True)
    kl = kl_penalty(logp, REF, kind)
    kl.sum().backward()
    torch.testing.assert_close(kl.detach(), kl_penalty(LOGP, REF, kind[:-1]))
    torch.testing.assert_close(logp.grad, torch.tensor([[1.0, -1.0]], dtype=F64))  # k2's gradient: logp - ref


def test_k3_clamps():
    # logp - ref = -30: r = 30 -> clamped to 20, e^20 - 21 -> clamped to 10.
    # logp - ref = +30: r = -30 -> -20, e^-20 + 19 = 19.000000002 -> clamped to 10.
    kl = kl_penalty(torch.tensor([[-30.0, 30.0]], dtype=F64), torch.zeros(1, 2, dtype=F64), "k3")
    torch.testing.assert_close(kl, torch.tensor([[10.0, 10.0]], dtype=F64))


def test_kl_penalty_errors():
    with pytest.raises(ValueError, match="full_kl_penalty"):
        kl_penalty(LOGP, REF, "full")
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LOGP, REF, "k4")
    assert "k3+" in KL_KINDS_ALL


def test_full_kl_single_process():
    # p = softmax([0, ln 3]) = [1/4, 3/4], q = uniform [1/2, 1/2]:
    # KL = 1/4 ln(1/2) + 3/4 ln(3/2)
    logits = torch.tensor([[[0.0, math.log(3.0)]]], dtype=F64)
    kl = full_kl_penalty(logits, torch.zeros_like(logits))
    assert kl.shape == (1, 1)
    assert kl.item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5))


def test_apply_kl_penalty():
    scores = torch.tensor([[0.0, 0.0, 1.0]], dtype=F64)
    logp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=F64)
    ref = torch.tensor([[-2.0, -1.0, -1.5]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    rewards, current_kl = apply_kl_penalty(scores, logp, ref, mask, kl_coef=0.1, kind="kl")
    # kl = [1, 0, 0.5] * mask = [1, 0, 0]; rewards = scores - 0.1 * kl; current_kl = mean(1, 0) = 0.5
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.0, 1.0]], dtype=F64))
    assert current_kl == pytest.approx(0.5)


def test_fixed_controller():
    ctrl = FixedKLController(0.05)
    ctrl.update(100.0, n_steps=256)
    assert ctrl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.05


def test_raise_coef_doubles_up_to_the_cap():
    # The KL guard's action: 0.05 * 2 = 0.1, then 0.2 capped at 0.15; no cap: 0.05 * 2 * 2 = 0.2.
    capped = FixedKLController(0.05, max_kl_coef=0.15)
    capped.raise_coef(2.0)
    assert capped.value == pytest.approx(0.1)
    capped.raise_coef(2.0)
    assert capped.value == pytest.approx(0.15)
    free = FixedKLController(0.05)
    free.raise_coef(2.0)
    free.raise_coef(2.0)
    assert free.value == pytest.approx(0.2)
    adaptive = AdaptiveKLController(0.2, target_kl=1.0, horizon=100, max_kl_coef=0.3)
    adaptive.raise_coef(2.0)  # 0.4 -> 0.3
    assert adaptive.value == pytest.approx(0.3)


def test_adaptive_controller_trajectory():
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    # kl 9: error clip(9/6 - 1 = 0.5) = 0.2; coef *= 1 + 0.2 * 256 / 10000 = 1.00512
    ctrl.update(9.0, n_steps=256)
    assert ctrl.value == pytest.approx(0.2 * 1.00512)
    # kl 3: error clip(-0.5) = -0.2; coef *= 0.99488
    ctrl.update(torch.tensor(3.0), n_steps=256)
    assert ctrl.value == pytest.approx(0.2 * 1.00512 * 0.99488)
    # kl 6.6: error 0.1 (inside the clip); coef *= 1 + 0.1 * 1000 / 10000 = 1.01
    ctrl.update(6.6, n_steps=1000)
    assert ctrl.value == pytest.approx(0.2 * 1.00512 * 0.99488 * 1.01)


def test_adaptive_controller_clamp_and_checkpoint():
    ctrl = AdaptiveKLController(0.2, target_kl=1.0, horizon=100, min_kl_coef=0.19, max_kl_coef=0.21)
    ctrl.update(10.0, n_steps=100)  # 0.2 * 1.2 = 0.24 -> clamped to 0.21
    assert ctrl.value == pytest.approx(0.21)
    for _ in range(3):
        ctrl.update(0.0, n_steps=100)  # * 0.8 each time -> clamped at 0.19
    assert ctrl.value == pytest.approx(0.19)

    resumed = AdaptiveKLController(0.2, target_kl=1.0, horizon=100, min_kl_coef=0.19, max_kl_coef=0.21)
    resumed.load_state_dict(ctrl.state_dict())
    ctrl.update(1.1, n_steps=10)
    resumed.update(1.1, n_steps=10)
    assert resumed.value == ctrl.value


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(init_kl_coef=0.1, target_kl=1.0, horizon=0), "horizon"),
        (dict(init_kl_coef=0.1, target_kl=0.0, horizon=10), "target_kl"),
        (dict(init_kl_coef=0.1, target_kl=1.0, horizon=10, min_kl_coef=0.2), "init_kl_coef"),
    ],
)
def test_adaptive_controller_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveKLController(**kwargs)
