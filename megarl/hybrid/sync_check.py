"""The trainer's weight-sync check (rollout.verify_weights) as one object per process: after a
sync, the engine's log-probs of its own samples must equal the actor's (megarl.hybrid.verify has
the statistics and the per-dtype limits). It holds the one piece of state the policy needs: the
first check of this process is fatal (WeightSyncMismatch: layout and name-mapping bugs), later
ones fire the guard/weight_sync event and training goes on."""
from __future__ import annotations

from typing import Callable

import torch

from megarl.hybrid.verify import WeightSyncMismatch, mismatch_message, sync_limits, sync_problem, sync_stats
from megarl.step.global_batch import GlobalBatch, LocalStats
from megarl.step.samples import RolloutBatch
from megarl.step.step_record import StepResult


class WeightSyncCheck:
    """rollout.verify_weights of one process. rollout: the rollout config section; dtype: model.dtype;
    family: the actor's model family (named in the error); log: rank 0 logs the guard's line."""

    def __init__(self, rollout, dtype: str, family: str, global_batch: GlobalBatch, log: Callable[[str], object], rank: int):
        self.rollout, self.dtype, self.global_batch, self.log, self.rank = rollout, dtype, global_batch, log, rank
        self.where = f"rollout.engine={rollout.engine} ({family} model)"
        self.checked = False  # the first weight-sync check of this process is fatal

    def __call__(self, step: int, rollout_batch: RolloutBatch, actor_logprobs: torch.Tensor, mask: torch.Tensor) -> StepResult:
        """The engine's log-probs of its own samples against the actor's (megarl.hybrid.verify). The
        first check of this process raises WeightSyncMismatch over the limit; later ones fire
        guard/weight_sync. Returns the statistics as metrics and the events; a collective over the DP group."""
        truncated = self.rollout.top_k > 0 or self.rollout.top_p < 1.0
        if not self.rollout.verify_weights or (truncated and not rollout_batch.logprobs_are_scaled):
            return StepResult({}, [])  # processed log-probs of a truncated distribution are not what the actor computes
        stats = self.global_stats(rollout_batch.rollout_logprobs, actor_logprobs, mask)
        first, self.checked = not self.checked, True
        metrics = {f"training/sync_logprob_diff_{k}": stats[k] for k in ("mean", "p99", "max")}
        # per dtype: a statistic that bf16 kernel noise passes and a corrupted layer does not; judged
        # on the worst rank's mean (a bad shard on one rank must not hide in the global mean)
        limit = self.rollout.verify_weights_mean_atol
        problem = sync_problem({**stats, "mean": stats["worst_rank_mean"]}, self.dtype, limit)
        if problem is None:
            return StepResult(metrics, [])
        if first:  # every rank holds the same stats, so every rank raises here
            raise WeightSyncMismatch(mismatch_message(self.where, problem + " (first sync of this run)"))
        if self.rank == 0:
            self.log(f"megarl: step {step}: guard/weight_sync: {self.where}: {problem}; training goes on "
                     "(only the first sync is fatal; rollout.verify_weights_mean_atol sets the limit)")
        limits = sync_limits(self.dtype, limit)
        return StepResult(metrics, [("guard/weight_sync", {**metrics, "mean_limit": limits.mean_atol})])

    def global_stats(self, engine_logprobs: torch.Tensor, actor_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
        """sync_stats over the DP group, identical on every rank: mean over all tokens, the worst
        rank's mean, the largest rank's p99, max, tokens (one all-gather)."""
        local = sync_stats(engine_logprobs, actor_logprobs, mask)
        stats = LocalStats()
        stats.masked_mean("mean", torch.tensor(local["mean"]), torch.tensor(local["tokens"]))  # token-weighted
        for name in ("mean", "p99", "max"):
            stats.max(f"worst_rank_{name}", torch.tensor(local[name]))
        stats.sum("tokens", torch.tensor(local["tokens"]))
        out = self.global_batch.reduce(stats)
        return {"mean": out["mean"], "worst_rank_mean": out["worst_rank_mean"], "p99": out["worst_rank_p99"],
                "max": out["worst_rank_max"], "tokens": out["tokens"]}
