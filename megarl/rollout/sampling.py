"""Logit processing and per-row seeded sampling, as pure tensor functions.

The order of operations follows vLLM's sampler (temperature, then top-k, then top-p over the
ascending-sorted distribution), so `processed` log-probs mean the same thing in every engine.
"""
from __future__ import annotations

from typing import Sequence

import torch


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                   banned_token_ids: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (processed_logprobs, scaled_logprobs), both [B, V] float32.

    logits: [B, V]. scaled = log_softmax(logits / T) over the allowed vocabulary (banned tokens'
    logits at -inf; T = 1 when greedy): the policy the actor recomputes, since a ban is part of the
    policy's definition (docs/algorithms.md, "Banned tokens"). processed = the same after masking
    tokens outside top-k and the top-p nucleus to -inf and renormalising: the distribution actually
    sampled from. Greedy (T = 0) leaves logits unscaled and untruncated, except that banned tokens
    are never picked. Banned tokens are removed first (as vLLM applies bad words and logit bias
    before top-k/top-p), so top-k counts allowed tokens.
    """
    logits = logits.float()
    banned = list(banned_token_ids)
    if banned:
        logits = logits.index_fill(-1, torch.tensor(banned, device=logits.device), float("-inf"))
    if temperature == 0.0:
        lp = torch.log_softmax(logits, dim=-1)
        return lp, lp
    scaled = logits / temperature
    scaled_lp = torch.log_softmax(scaled, dim=-1)
    masked = scaled
    V = logits.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(masked, top_k, dim=-1).values[:, -1:]  # [B, 1]; ties with the k-th stay in
        masked = masked.masked_fill(masked < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(masked, dim=-1, descending=False)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - top_p)
        drop_sorted[:, -1] = False  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        masked = masked.masked_fill(drop, float("-inf"))
    if masked is scaled:
        return scaled_lp, scaled_lp
    return torch.log_softmax(masked, dim=-1), scaled_lp


def sample_rows(processed_logprobs: torch.Tensor, generators: Sequence[torch.Generator | None], greedy: bool) -> torch.Tensor:
    """Pick one token per row: argmax when greedy, else inverse-CDF with one uniform per row.

    processed_logprobs: [B, V]. generators[i] draws row i's uniform, so a row's token depends
    only on its own logits and generator, not on which other rows share the batch. Returns [B]
    int64. Rows whose generator is None (finished rows) get token 0 without consuming randomness.
    """
    if greedy:
        return processed_logprobs.argmax(dim=-1)
    # One float64 uniform per live row from that row's CPU generator; the search runs batched
    # on the logits' device.
    # Drawn as Python floats and made one tensor (two tensor ops per row, an index-put each, cost
    # more than the model's decode step on the CPU demo); the same draws, so the same tokens.
    u = torch.tensor([[torch.rand((), generator=g, dtype=torch.float64).item() if g is not None else 0.0]
                      for g in generators], dtype=torch.float64)
    idx = inverse_cdf(processed_logprobs.double().exp(), u)
    dead = [i for i, g in enumerate(generators) if g is None]
    if dead:
        idx[torch.tensor(dead, device=idx.device)] = 0
    return idx


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds u * total ([B, V], [B, 1] -> [B]).

    One cumulative sum over the vocabulary: a token where the cdf first exceeds u * total has
    probability > 0 (the cdf rose there), so zero-probability tokens can never be picked. Only
    when u * total rounds up to the total does the search run past the end; those rows (about
    one in 2**53) take their last positive token, found on that row alone.
    """
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, u.to(cdf.device) * cdf[:, -1:], right=True).squeeze(-1)
    past_end = (idx == probs.shape[-1]).nonzero().squeeze(1).tolist()
    for row in past_end:
        idx[row] = (probs[row] > 0).nonzero()[-1, 0]
    return idx
