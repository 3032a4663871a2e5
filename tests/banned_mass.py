"""Test helper: the tokens a random model likes, to ban (rollout.banned_token_ids) so that the ban
removes most of the probability mass, the hardest case for train/rollout log-prob agreement."""
from __future__ import annotations

import torch


def heavy_tokens(model, min_mass: float) -> tuple[int, ...]:
    """The fewest tokens, most probable first, holding `min_mass` of a transformers model's average
    next-token distribution on random text."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (8, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        avg = model(ids).logits.float().softmax(-1).reshape(-1, vocab).mean(0)
    mass, order = avg.sort(descending=True)
    count = int((mass.cumsum(0) < min_mass).sum()) + 1
    return tuple(sorted(order[:count].tolist()))
