"""KL between the policy and the reference model: per-token estimators, the exact full-vocabulary
KL, and the coefficient controllers.

All estimators estimate KL(pi || ref) from the log-probs of the sampled token, following
J. Schulman, "Approximating KL divergence" (2020), http://joschu.net/blog/kl-approx.html, with
r = ref_logp - logp (the log of ref/pi at the sampled token):
    kl / k1          -r = logp - ref_logp                 unbiased, high variance, can be negative
    abs              |logp - ref_logp|
    mse / k2         0.5 * (logp - ref_logp)^2            biased, low variance; its gradient is
                                                           the unbiased gradient of KL
    low_var_kl / k3  exp(r) - r - 1, r clamped to [-20, 20] and the result to [-10, 10] (verl's bounds)
A trailing "+" (e.g. "k3+") is straight-through: the value of the named estimator with the gradient
of k2, because k1 and k3 have the right expectation but not the right expected gradient.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megarl.algorithms.functional import masked_mean
from megarl.models.vocab_parallel import vocab_parallel_full_kl

KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_KINDS_ALL = KL_KINDS + tuple(kind + "+" for kind in KL_KINDS)


def _kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("kl", "k1"):
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logp - ref_logp).square()
    # low_var_kl / k3; the clamps keep exp() finite and bound the penalty of a single bad token.
    log_ratio = torch.clamp(ref_logp - logp, min=-20, max=20)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref); logp, ref_logp and the result are [batch, response_len].

    kind: one of KL_KINDS_ALL (see the module docstring). For "full", the exact KL over the whole
    vocabulary, the logits are needed: call `full_kl_penalty(logits, ref_logits, tp_group)`.
    """
    if kind == "full":
        raise ValueError(
            "kind='full' is the exact KL over the vocabulary and needs the logits, not log-probs of the sampled "
            "token: call megarl.algorithms.full_kl_penalty(logits, ref_logits, tp_group=...) instead"
        )
    if kind not in KL_KINDS_ALL:
        raise ValueError(
            f"unknown KL estimator {kind!r}; valid: {', '.join(KL_KINDS_ALL)}, or 'full' via full_kl_penalty"
        )
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"logp and ref_logp must have the same shape, got {tuple(logp.shape)} and {tuple(ref_logp.shape)}"
        )
    base = kind.removesuffix("+")
    value = _kl_estimate(logp, ref_logp, base)
    if not kind.endswith("+") or base in ("mse", "k2"):
        return value
    k2 = 0.5 * (logp - ref_logp).square()
    return k2 - k2.detach() + value.detach()


def full_kl_penalty(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    true_vocab_size: int | None = None,
    banned_token_ids: Sequence[int] = (),
) -> torch.Tensor:
    """kl_penalty kind "full": exact KL(pi || ref) = sum_v p(v) log(p(v) / q(v)) per token.

    logits, ref_logits: [batch, response_len, local_vocab] vocab-parallel slices (full vocabulary
    when tp_group is None), already divided by the sampling temperature. Returns
    [batch, response_len], identical on every TP rank; nothing is gathered. Arguments as in
    `megarl.models.vocab_parallel`, banned tokens (rollout.banned_token_ids) included (verl leaves
    this kind unimplemented).
    """
    return vocab_parallel_full_kl(logits, ref_logits, tp_group, vocab_start, true_vocab_size, banned_token_ids)


@torch.no_grad()
def apply_kl_penalty(
    token_scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str = "kl",
) -> tuple[torch.Tensor, float]:
    """KL-in-reward (Ziegler et al. 2019): token_rewards = token_scores - kl_coef * kl (masked).

    All tensors [batch, response_len]; logp are the rollout policy's log-probs (old_logp).
    Returns (token_rewards, current_kl) where current_kl is the batch mean of each sequence's
    masked-mean KL, the value verl feeds to `AdaptiveKLController.update` with n_steps = batch.
    """
    kld = kl_penalty(logp, ref_logp, kind) * response_mask.to(logp.dtype)
    token_rewards = token_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, dim=-1).mean().item()
    return token_rewards, current_kl


class FixedKLController:
    """A constant KL coefficient; `update` is a no-op. Only `raise_coef` (the KL guard) moves it,
    up to max_kl_coef."""

    def __init__(self, kl_coef: float, max_kl_coef: float | None = None):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)
        self.max_kl_coef = max_kl_coef

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """No-op (kept so both controllers are used the same way)."""

    def raise_coef(self, factor: float) -> None:
        """Multiply the coefficient by factor, capped at max_kl_coef (the KL guard's action)."""
        self.value = _capped(self.value * factor, self.max_kl_coef)

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (https://arxiv.org/abs/1909.08593), section 2.2.

    After each batch: error = clip(current_kl / target_kl - 1, -0.2, 0.2) and
    value *= 1 + error * n_steps / horizon, with n_steps the number of sequences in the batch,
    so the coefficient moves by at most 20% per `horizon` sequences. min_kl_coef / max_kl_coef
    (optional, e.g. 1e-4 and 10) clamp the coefficient after each update so a long stretch of
    off-target KL cannot drive it to 0 or blow it up.
    """

    def __init__(
        self,
        init_kl_coef: float,
        target_kl: float,
        horizon: float,
        min_kl_coef: float | None = None,
        max_kl_coef: float | None = None,
    ):
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0 (sequences over which the coefficient may move 20%), got {horizon}")
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        low = -math.inf if min_kl_coef is None else min_kl_coef
        high = math.inf if max_kl_coef is None else max_kl_coef
        if not low <= init_kl_coef <= high:
            raise ValueError(
                f"init_kl_coef={init_kl_coef} must lie within "
                f"[min_kl_coef, max_kl_coef] = [{min_kl_coef}, {max_kl_coef}]"
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)
        self.min_kl_coef = min_kl_coef
        self.max_kl_coef = max_kl_coef

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Move the coefficient toward the value that keeps the measured KL at target_kl."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        if self.min_kl_coef is not None:
            self.value = max(self.value, self.min_kl_coef)
        if self.max_kl_coef is not None:
            self.value = min(self.value, self.max_kl_coef)

    def raise_coef(self, factor: float) -> None:
        """Multiply the coefficient by factor, capped at max_kl_coef (the KL guard's action)."""
        self.value = _capped(self.value * factor, self.max_kl_coef)

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state (the coefficient; target and horizon come from the config)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output."""
        self.value = float(state["value"])


def _capped(value: float, cap: float | None) -> float:
    return value if cap is None else min(value, cap)
