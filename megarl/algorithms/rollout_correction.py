"""Off-policy correction between the rollout engine (behaviour policy) and the trainer.

Three policies: the engine's log-probs of its own samples (`rollout_logp`, the behaviour policy
that generated them: an older version under async training, other kernels always), the trainer's
recomputed log-probs before the update (`old_logp`, the proximal policy, PPO's clip anchor) and the
policy being trained (`logp`). Every mode works on the per-token ratio

    r_t = exp(old_logp_t - rollout_logp_t)      (log clamped to +-20, verl's SAFETY_BOUND)

and returns per-token weights that multiply PPO's per-token loss (`policy_loss(...,
rollout_is_weights=)`) plus the loss mask the update aggregates over:

    mode       weight w                                         loss mask
    none       (no weights)                                     response mask
    tis        min(r_t, C)  (token)  or  min(prod_t r_t, C)      response mask
               broadcast (sequence), C = rollout_is_threshold
    mis        rho_i = prod_t r_t if lo <= rho_i <= hi, else     the rejected sequences removed
               the sequence is rejected                          (excluded from the denominator)
    icepop     r_t if lo <= r_t <= hi, else 0                    response mask
    decoupled  r_t (AReaL's behaviour weight pi_prox/pi_behav;   response mask
               with a cap, tokens above it get 0)

Why these definitions: TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL") truncates the weight at C from above only (verl `rollout_is`, `.clamp(max=)`;
slime `--tis-clip-low 0`). MIS (Liu, Li et al. 2025, "When speed kills stability") rejects whole
sequences whose product ratio leaves [lo, hi] (verl `rollout_rs: sequence`, the preset
`decoupled_seq_is_rs` with band 0.5_2.0): like verl, rejection changes the loss mask, so a rejected
sequence leaves the loss's denominator too. IcePop (Ling team 2025, Ring-1T) zeroes tokens whose
ratio leaves [0.5, 5] and keeps the others' ratio as weight; as in the paper's objective and verl,
the denominator is unchanged. The decoupled PPO loss (Hilton et al. 2021; AReaL `use_decoupled_loss`)
is L = (pi_prox / pi_behav) * min(rho A, clip(rho, 1 - eps, 1 + eps) A) with rho = pi_theta / pi_prox:
the weight is r_t with pi_prox = the trainer's log-probs (`old_logp`, recomputed with the weights
the update starts from, so at any staleness K >= 0) and pi_behav = the engine's; AReaL's
`behav_imp_weight_cap` zeroes tokens whose weight exceeds it (null: no cap).

The ratio must compare one distribution computed twice: `rollout_logp` are the engine's log-probs
of softmax(logits / T) over the allowed vocabulary, without top-k/top-p truncation, which is what
the trainer recomputes (docs/algorithms.md, "Off-policy correction", says why).

Pure tensor math, per sequence: nothing here needs the rest of the global batch.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

CORRECTION_MODES = ("none", "tis", "mis", "icepop", "decoupled")
IS_LEVELS = ("token", "sequence")
SAFETY_LOG_BOUND = 20.0  # exp(+-20): verl's rollout_corr_helper bound, keeps a stale token from overflowing exp


class CorrectionTerms(NamedTuple):
    """What a mode does to a batch [batch, response_len] (the step turns it into its record,
    megarl.step.step_record.Correction, with the metrics reduced over the global batch).

    weights: multiply the per-token policy loss (0 on padding); None for mode none.
    loss_mask: the mask the actor's loss aggregates over (the response mask minus rejected sequences).
    clipped: bool, tokens whose weight was truncated (TIS).
    masked: bool, valid tokens whose weight was set to 0 or whose sequence was rejected.
    """

    weights: torch.Tensor | None
    loss_mask: torch.Tensor
    clipped: torch.Tensor
    masked: torch.Tensor


def log_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """log r_t = old_logp - rollout_logp on valid tokens (0 elsewhere, NaN under the mask included)."""
    valid = response_mask > 0
    return torch.where(valid, old_logp - rollout_logp, torch.zeros_like(old_logp))


def sequence_log_ratio(token_log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[batch] log prod_t r_t = sum_t log r_t over valid tokens (verl's seq_sum_k1)."""
    return (token_log_ratio * (response_mask > 0)).sum(dim=-1)


def _safe_exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.clamp(x, -SAFETY_LOG_BOUND, SAFETY_LOG_BOUND))


def compute_rollout_correction(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    *,
    rollout_is: str = "token",
    rollout_is_threshold: float = 2.0,
    rollout_rs_threshold: float = 2.0,
    rollout_rs_threshold_lower: float | None = None,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
    behav_imp_weight_cap: float | None = None,
) -> CorrectionTerms:
    """The weights and loss mask of `mode` (see the module doc) for one batch.

    old_logp: the trainer's log-probs before the update (proximal); rollout_logp: the engine's
    (behaviour); response_mask: 1 on tokens the policy generated. rollout_is: the TIS weight's level,
    token or sequence. rollout_is_threshold: TIS's C. rollout_rs_threshold(_lower): MIS's band on the
    sequence ratio; lower None = 1 / upper (verl's default). icepop_low/high: IcePop's band.
    behav_imp_weight_cap: decoupled's cap (None = none).
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(f"unknown rollout correction mode {mode!r}; valid: {', '.join(CORRECTION_MODES)}")
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {IS_LEVELS}, got {rollout_is!r}")
    if not old_logp.shape == rollout_logp.shape == response_mask.shape:
        raise ValueError(f"old_logp, rollout_logp and response_mask must have one shape [batch, response_len], got "
                         f"{tuple(old_logp.shape)}, {tuple(rollout_logp.shape)}, {tuple(response_mask.shape)}")
    valid = response_mask > 0
    none = torch.zeros_like(valid)
    mask = response_mask.to(old_logp.dtype)
    lr = log_ratio(old_logp.detach(), rollout_logp.detach(), response_mask)
    if mode == "none":
        return CorrectionTerms(None, response_mask, none, none)

    if mode == "tis":
        if rollout_is == "sequence":
            ratio = _safe_exp(sequence_log_ratio(lr, response_mask)).unsqueeze(-1).expand_as(lr)
        else:
            ratio = _safe_exp(lr)
        clipped = (ratio > rollout_is_threshold) & valid
        return CorrectionTerms(ratio.clamp(max=rollout_is_threshold) * mask, response_mask, clipped, none)

    if mode == "mis":
        upper = rollout_rs_threshold
        lower = 1.0 / upper if rollout_rs_threshold_lower is None else rollout_rs_threshold_lower
        rho = _safe_exp(sequence_log_ratio(lr, response_mask))
        keep = ((rho >= lower) & (rho <= upper)).unsqueeze(-1)
        loss_mask = response_mask * keep.to(response_mask.dtype)
        weights = rho.unsqueeze(-1) * keep * mask
        return CorrectionTerms(weights, loss_mask, none, valid & ~keep)

    ratio = _safe_exp(lr)
    if mode == "icepop":
        keep = (ratio >= icepop_low) & (ratio <= icepop_high)
    else:  # decoupled
        keep = torch.ones_like(valid) if behav_imp_weight_cap is None else ratio <= behav_imp_weight_cap
    return CorrectionTerms(ratio * keep * mask, response_mask, none, valid & ~keep)


# --- metrics ----------------------------------------------------------------------------------------
# Each metric is a partial (kind, numerator-or-value, denominator) so a trainer can reduce it over
# data-parallel ranks (megarl.step.global_batch.LocalStats) and get the global-batch value; `metrics` does
# the same reduction over one batch. Names are verl's (rollout_corr_helper.compute_offpolicy_metrics).

def metric_partials(corr: CorrectionTerms, old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                    response_mask: torch.Tensor) -> list[tuple[str, str, torch.Tensor, torch.Tensor | None]]:
    """[(kind, name, x, mask)] with kind "mean" (masked mean of x), "max" or "min" (over x's entries).

    rollout_corr/kl: mean of log pi_rollout - log pi_old, the k1 estimate of KL(rollout || trainer)
    from the rollout's own samples; rollout_corr/k3_kl: mean of r - 1 - log r (Schulman's k3, >= 0).
    rollout_is_mean/max/min: the weights over the tokens the loss counts (mode != none);
    rollout_is_ratio_fraction_high: fraction of valid tokens TIS truncated; rollout_rs_masked_fraction:
    fraction of valid tokens zeroed or rejected; rollout_rs_seq_masked_fraction: fraction of sequences
    (with a valid token) holding a zeroed or rejected token.
    """
    mask = (response_mask > 0).to(torch.float64)
    lr = log_ratio(old_logp.double(), rollout_logp.double(), response_mask)
    k3 = _safe_exp(lr) - 1.0 - lr
    out = [("mean", "rollout_corr/kl", -lr, mask), ("mean", "rollout_corr/k3_kl", k3, mask)]
    if corr.weights is None:
        return out
    counted = corr.loss_mask > 0
    w = corr.weights.double()
    seqs = (mask.sum(-1) > 0).to(torch.float64)
    out += [
        ("mean", "rollout_corr/rollout_is_mean", w, counted.to(torch.float64)),
        ("mean", "rollout_corr/rollout_is_sq_mean", w * w, counted.to(torch.float64)),  # for the ESS
        ("max", "rollout_corr/rollout_is_max", w[counted], None),
        ("min", "rollout_corr/rollout_is_min", w[counted], None),
        ("mean", "rollout_corr/rollout_is_ratio_fraction_high", corr.clipped.to(torch.float64), mask),
        ("mean", "rollout_corr/rollout_rs_masked_fraction", corr.masked.to(torch.float64), mask),
        ("mean", "rollout_corr/rollout_rs_seq_masked_fraction", corr.masked.any(-1).to(torch.float64), seqs),
    ]
    return out


def finish_metrics(values: dict[str, float]) -> dict[str, float]:
    """Reduced partials -> the logged metrics: adds verl's effective sample size
    rollout_is_eff_sample_size = mean(w)^2 / mean(w^2) (1 when all weights are equal) and drops the
    helper rollout_is_sq_mean."""
    out = dict(values)
    sq = out.pop("rollout_corr/rollout_is_sq_mean", None)
    if sq is not None:
        out["rollout_corr/rollout_is_eff_sample_size"] = out["rollout_corr/rollout_is_mean"] ** 2 / sq if sq > 0 else 0.0
    for name in ("rollout_corr/rollout_is_max", "rollout_corr/rollout_is_min"):
        if name in out and abs(out[name]) == float("inf"):  # every token rejected: nothing to report
            out[name] = 0.0
    return out


def metrics(corr: CorrectionTerms, old_logp: torch.Tensor, rollout_logp: torch.Tensor,
            response_mask: torch.Tensor) -> dict[str, float]:
    """The rollout_corr/ metrics of one batch (python floats)."""
    values = {}
    for kind, name, x, mask in metric_partials(corr, old_logp, rollout_logp, response_mask):
        if kind == "mean":
            values[name] = float((x * mask).sum() / mask.sum().clamp_min(1))
        elif x.numel() == 0:
            values[name] = float("-inf") if kind == "max" else float("inf")
        else:
            values[name] = float(x.max() if kind == "max" else x.min())
    return finish_metrics(values)
