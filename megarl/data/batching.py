"""Padding of token-id lists into tensors: prompts are left-padded (generation continues at the
right edge), full sequences right-padded."""
from __future__ import annotations

from typing import Sequence

import torch


def pad_left(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, max_len] with pad_id on the left, attention mask [B, max_len] (1 = token)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s):] = torch.as_tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, length] with pad_id on the right, attention mask [B, length] (1 = token);
    length defaults to the longest sequence."""
    width = length or max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask
