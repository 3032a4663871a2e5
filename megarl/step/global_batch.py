"""Statistics over the global batch: each data-parallel rank holds a slice of the step's samples.

Every function is a collective over the DP group (a no-op when dp == 1) and returns the same value
on every rank, so metrics and batch-wide quantities (whitening, group baselines) do not depend on
how samples are split over ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.algorithms import masked_var
from megarl.distributed.parallel import ParallelDims, all_gather_host, all_reduce_host


class LocalStats:
    """This rank's partial statistics of the step, named; `GlobalBatch.reduce` turns them into
    global values with one collective. Each partial is computed exactly as the matching
    single-statistic method of GlobalBatch computes it, so both give the same numbers."""

    def __init__(self):
        self.ratios: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (numerator, denominator)
        self.totals: dict[str, torch.Tensor] = {}
        self.maxima: dict[str, torch.Tensor] = {}
        self.negated: set[str] = set()  # minima, kept as maxima of -x

    def mean(self, name: str, x: torch.Tensor) -> None:
        self.ratios[name] = (x.double().sum(), torch.tensor(float(x.numel()), dtype=torch.float64))

    def masked_mean(self, name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
        self.ratios[name] = ((x.double() * mask).sum(), mask.sum())

    def sum(self, name: str, x: torch.Tensor) -> None:
        self.totals[name] = x.detach().double().sum()

    def max(self, name: str, x: torch.Tensor) -> None:
        self.maxima[name] = x.detach().double().max() if x.numel() else torch.tensor(float("-inf"), dtype=torch.float64)

    def min(self, name: str, x: torch.Tensor) -> None:
        self.maxima[name] = (-x.detach().double()).max() if x.numel() else torch.tensor(float("-inf"), dtype=torch.float64)
        self.negated.add(name)


class GlobalBatch:
    def __init__(self, dims: ParallelDims):
        self.dims = dims

    def _sum(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        return all_reduce_host(t, self.dims.dp_group, op=op) if self.dims.dp > 1 else t

    def gather(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's rows concatenated over DP ranks, in DP-rank order (= global sample order)."""
        if self.dims.dp == 1:
            return list(tensors)
        return [torch.cat(all_gather_host(t, self.dims.dp_group, self.dims.dp)) for t in tensors]

    def gather_objects(self, obj) -> list:
        """Every DP rank's picklable `obj`, in DP-rank order."""
        if self.dims.dp == 1:
            return [obj]
        out: list = [None] * self.dims.dp
        dist.all_gather_object(out, obj, group=self.dims.dp_group)
        return out

    def reduce(self, stats: LocalStats) -> dict[str, float]:
        """Every statistic in `stats` over the global batch, in one all-gather over the DP group."""
        ratios, totals, maxima = list(stats.ratios), list(stats.totals), list(stats.maxima)
        row = torch.stack([stats.ratios[k][0].double() for k in ratios] + [stats.ratios[k][1].double() for k in ratios]
                          + [stats.totals[k] for k in totals] + [stats.maxima[k] for k in maxima]).reshape(-1)
        rows = torch.stack(all_gather_host(row, self.dims.dp_group, self.dims.dp)) if self.dims.dp > 1 else row[None]
        n_sum = 2 * len(ratios) + len(totals)
        summed, peak = rows[:, :n_sum].sum(0), rows[:, n_sum:].max(0).values
        out = {k: float(summed[i] / summed[len(ratios) + i].clamp_min(1)) for i, k in enumerate(ratios)}
        out.update({k: float(summed[2 * len(ratios) + i]) for i, k in enumerate(totals)})
        out.update({k: float(peak[i]) * (-1.0 if k in stats.negated else 1.0) for i, k in enumerate(maxima)})
        return out

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
        r, v, m = self.gather(returns, values, mask)
        return float(1.0 - masked_var(r - v, m) / (masked_var(r, m) + 1e-8))
