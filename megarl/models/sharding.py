"""How one rank's share of a model weight relates to the full tensor.

This is the contract between the model layer (which knows Megatron-Core's parameter layout) and
everything that moves weights around it: the HF exporter, the 3D-HybridEngine and checkpoints.
Names are *global*: layer numbers count over the whole model (not per pipeline stage) and
expert numbers over all experts (not per expert-parallel rank), so a name means the same tensor
under every parallel layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardMeta:
    """Placement of one global weight on this rank.

    full_shape: shape of the canonical (layout-independent) full tensor.
    tp_dim: dimension split over the tensor-parallel group, or None when every TP rank holds it
        whole (layer norms, biases of row-parallel layers, the router).
    tp_rank, tp_size: this rank's position in the group that splits it (the expert-TP group for
        expert weights).
    tp_sub_chunks: the local shard is `tp_sub_chunks` equal blocks along tp_dim, block j being
        rank tp_rank's slice of the j-th block of the full tensor. Megatron's gated MLP fc1 holds
        [gate_shard; up_shard], so it has 2; everything else has 1.
    """

    full_shape: tuple[int, ...]
    tp_dim: int | None
    tp_rank: int
    tp_size: int
    tp_sub_chunks: int = 1

    def slice_of_full(self, full: torch.Tensor, tp_rank: int | None = None, tp_size: int | None = None) -> torch.Tensor:
        """The shard that rank `tp_rank` of `tp_size` holds of `full` (defaults: this rank's own)."""
        rank = self.tp_rank if tp_rank is None else tp_rank
        size = self.tp_size if tp_size is None else tp_size
        if self.tp_dim is None or size == 1:
            return full
        blocks = full.chunk(self.tp_sub_chunks, dim=self.tp_dim)
        return torch.cat([b.chunk(size, dim=self.tp_dim)[rank] for b in blocks], dim=self.tp_dim)

    def full_from_shards(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """Reassemble the full tensor from the shards of TP ranks 0..tp_size-1 (in order)."""
        if self.tp_dim is None or len(shards) == 1:
            return shards[0]
        per_rank_blocks = [s.chunk(self.tp_sub_chunks, dim=self.tp_dim) for s in shards]
        blocks = [torch.cat([blocks[j] for blocks in per_rank_blocks], dim=self.tp_dim) for j in range(self.tp_sub_chunks)]
        return torch.cat(blocks, dim=self.tp_dim)
