"""Training and rollout layouts: which global rank sits where.

Training follows Megatron-Core's default order "tp-cp-ep-dp-pp" with cp = 1:
    rank = tp_rank + tp * (dp_rank + dp * pp_rank),
and expert parallelism is carved out of data parallelism (ep_rank = dp_rank % ep).

Rollout: `tp` ranks per engine instance, data parallel over the rest. Two ways to pick the
rollout TP groups (HybridFlow section 5, Fig. 8):
- "micro_dp": inside each training TP group, rollout TP rank q goes to the training TP ranks
  j with j // (t / t_g) == q, so every rank's training shard is a subset of its rollout shard and
  one all-gather inside each micro-DP group (same q, same training replica) finishes the
  transition. Rollout TP groups are then strided by t / t_g.
- "consecutive": rollout TP groups are blocks of `tp` consecutive global ranks, which is what
  vLLM (external_launcher) and SGLang (base_gpu_id + r) impose. Correct for any layout, but
  for 1 < t_g < t each rank also receives slices it could have held (docs/rollout.md).
  "micro_dp" falls back to consecutive groups when t_g does not divide t (no grouping makes
  every training shard a subset of a rollout shard then; the planner still moves only what is
  missing).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class RankCoords:
    pp: int
    tp: int
    dp: int
    ep: int


@dataclass(frozen=True)
class TrainLayout:
    """Training degrees; world_size = tp * pp * dp (cp = 1).

    ep only places experts in the synthetic model: the plan reads who holds which expert from the
    all-gathered local_shards metadata, so any Megatron expert layout (etp != tp included) works.
    """

    tp: int
    pp: int
    dp: int
    ep: int = 1

    def __post_init__(self):
        for k in ("tp", "pp", "dp", "ep"):
            if getattr(self, k) < 1:
                raise ValueError(f"TrainLayout.{k} must be >= 1, got {getattr(self, k)}")
        if self.dp % self.ep:
            raise ValueError(f"expert parallelism is carved out of data parallelism: dp={self.dp} is not divisible by ep={self.ep}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    def rank_of(self, pp: int, tp: int, dp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size} = tp {self.tp} x pp {self.pp} x dp {self.dp}")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return RankCoords(pp=pp, tp=tp, dp=dp, ep=dp % self.ep)

    def model_parallel_ranks(self, dp: int) -> list[int]:
        """The tp * pp ranks that together hold one copy of the (dense) model, ordered by mp rank."""
        return [self.rank_of(p, t, dp) for p in range(self.pp) for t in range(self.tp)]

    def mp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c.tp + self.tp * c.pp


Grouping = Literal["micro_dp", "consecutive"]


@dataclass(frozen=True)
class RolloutLayout:
    """tp: the TP degree of the shards the engine loads (1 = full tensors); grouping: see module doc.

    rows: ((tensor name, ((lo, hi) per rollout TP rank)), ...) for tensors the engine splits
    unevenly along their TP dimension (vLLM's padded vocabulary), in rows of the full tensor.
    """

    tp: int = 1
    grouping: Grouping = "micro_dp"
    rows: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"RolloutLayout.tp must be >= 1, got {self.tp}")
        if self.grouping not in ("micro_dp", "consecutive"):
            raise ValueError(f"RolloutLayout.grouping must be 'micro_dp' or 'consecutive', got {self.grouping!r}")


@dataclass(frozen=True)
class RolloutAssignment:
    """Per global rank: its rollout TP rank q, its rollout TP group, its micro-DP group."""

    rollout_tp_rank: tuple[int, ...]
    rollout_groups: tuple[tuple[int, ...], ...]  # each ordered by rollout TP rank
    micro_dp_groups: tuple[tuple[int, ...], ...]  # same q inside one training replica, sorted

    def group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.rollout_groups if rank in g)


def assign_rollout(train: TrainLayout, rollout: RolloutLayout) -> RolloutAssignment:
    """Place rollout TP ranks on the training ranks (HybridFlow micro-DP, or consecutive blocks)."""
    G, W = rollout.tp, train.world_size
    if W % G:
        raise ValueError(f"rollout tp {G} must divide the world size {W} = tp {train.tp} x pp {train.pp} x dp {train.dp}")
    q = [0] * W
    groups: list[tuple[int, ...]] = []
    if rollout.grouping == "micro_dp" and train.tp % G == 0:
        stride = train.tp // G  # q = j // stride, members of one rollout group share j % stride
        for r in range(W):
            q[r] = train.coords(r).tp // stride
        for d in range(train.dp):
            for p in range(train.pp):
                for m in range(stride):
                    groups.append(tuple(train.rank_of(p, qq * stride + m, d) for qq in range(G)))
    else:
        for r in range(W):
            q[r] = r % G
        groups = [tuple(range(s, s + G)) for s in range(0, W, G)]
    micro: dict[tuple[int, int], list[int]] = {}
    for r in range(W):
        micro.setdefault((train.coords(r).dp, q[r]), []).append(r)
    return RolloutAssignment(tuple(q), tuple(groups), tuple(tuple(sorted(v)) for _, v in sorted(micro.items())))


def hybridflow_bytes_per_rank(model_bytes: int, train: TrainLayout, rollout_tp: int) -> float:
    """HybridFlow's transition volume per GPU, (t*p - t_g) / (t_g * t * p) * M (p_g = 1).

    This is the lower bound when every rank's training shard is a subset of its rollout shard
    (micro-DP grouping, t_g dividing t); it ignores replicated tensors (norms), which are tiny.
    """
    tp = train.tp * train.pp
    return max(0.0, (tp - rollout_tp) / (rollout_tp * tp) * model_bytes)
