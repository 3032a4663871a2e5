"""Masked reductions shared by the advantage estimators and the losses.

A mask is 1 on tokens that count and 0 elsewhere (prompt padding, tokens after EOS, tool or
environment observations inside a multi-turn response). Values under a 0 are ignored even when
they are NaN or inf, so a caller never has to clean padding first.
"""
from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Sum of `x * mask` over `dim` (all elements when None); `x` and `mask` share a shape."""
    mask = mask.to(x.dtype)
    # torch.where rather than plain x * mask: NaN * 0 is NaN, and padding may hold NaN/inf.
    picked = torch.where(mask != 0, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Mean of `x` over the entries where `mask` is non-zero; 0 (not NaN) where nothing is selected."""
    total = masked_sum(x, mask, dim)
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim=dim)
    # An all-masked row (a prompt whose response was empty) must give 0, and a 0/0 would also put
    # NaN into the backward pass; the numerator is exactly 0 there, so any non-zero denominator works.
    return total / torch.where(count != 0, count, torch.ones_like(count))


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the selected entries of `x` (a 0-d tensor); unbiased (Bessel) by default, like verl."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.to(x.dtype).sum()
        # A data-dependent check (a host sync on GPU), kept because silently dividing by zero here
        # would whiten a whole batch of advantages into NaN.
        if count < 2:
            raise ValueError(
                f"masked_var(unbiased=True) needs at least 2 selected entries, got {int(count)}; "
                "whiten over a larger batch (e.g. the whole rollout batch, not one micro-batch)."
            )
        var = var * count / (count - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """`(x - mean) * rsqrt(var + 1e-8)` with the masked mean and unbiased masked variance.

    x, mask: any shape (typically [batch, response_len]). Entries outside the mask are transformed
    too (not zeroed), exactly as verl does; multiply by the mask if zeros are needed there.
    shift_mean=False adds the mean back after scaling (keeps the sign of rewards, as in trl/verl).
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
