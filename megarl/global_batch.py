"""Statistics over the global batch: each data-parallel rank holds a slice of the step's samples.

Every function is a collective over the DP group (a no-op when dp == 1) and returns the same value
on every rank, so metrics and batch-wide quantities (whitening, group baselines) do not depend on
how samples are split over ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.algorithms import masked_var
from megarl.parallel import ParallelDims, all_gather_host, all_reduce_host


class GlobalBatch:
    def __init__(self, dims: ParallelDims):
        self.dims = dims

    def _sum(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        return all_reduce_host(t, self.dims.dp_group, op=op) if self.dims.dp > 1 else t

    def gather(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Concatenate each tensor's rows over DP ranks, in DP-rank order (= global sample order)."""
        if self.dims.dp == 1:
            return tensors
        return {k: torch.cat(all_gather_host(t, self.dims.dp_group, self.dims.dp)) for k, t in tensors.items()}

    def offset(self, local_rows: int) -> int:
        """Index of this rank's first row in the gathered batch (every rank holds as many rows)."""
        return self.dims.dp_rank * local_rows

    def sum(self, x: torch.Tensor) -> float:
        return float(self._sum(x.detach().double().sum().reshape(1)))

    def mean(self, x: torch.Tensor) -> float:
        t = self._sum(torch.tensor([x.double().sum(), x.numel()], dtype=torch.float64))
        return float(t[0] / t[1].clamp_min(1))

    def masked_mean(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        t = self._sum(torch.tensor([(x.double() * mask).sum(), mask.sum()], dtype=torch.float64))
        return float(t[0] / t[1].clamp_min(1))

    def max(self, x: torch.Tensor) -> float:
        t = x.detach().double().max().reshape(1) if x.numel() else torch.tensor([float("-inf")], dtype=torch.float64)
        return float(self._sum(t, op=dist.ReduceOp.MAX))

    def min(self, x: torch.Tensor) -> float:
        return -self.max(-x)

    def explained_variance(self, returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
        """1 - Var[returns - values] / Var[returns] over valid tokens (verl's critic/vf_explained_var)."""
        g = self.gather({"r": returns, "v": values, "m": mask})
        return float(1.0 - masked_var(g["r"] - g["v"], g["m"]) / (masked_var(g["r"], g["m"]) + 1e-8))
