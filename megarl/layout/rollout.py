"""Rollout groups: which training ranks form one rollout engine instance, and each rank's rollout
TP rank.

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
A training "replica" is one copy of the dense weights: cp_rank + cp * dp_rank (ParallelLayout.replica).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarl.layout.parallel import ParallelLayout

ENGINES_WITHOUT_TP = ("hf",)  # one whole model per rank


def check_rollout(engine: str, tp: int, world_size: int | None = None) -> None:
    """Refuse a rollout layout no engine instance can take (ValueError naming the rollout.* keys)."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"rollout.tp must be a positive integer, got {tp!r}")
    if engine in ENGINES_WITHOUT_TP and tp != 1:
        raise ValueError(f"rollout.engine={engine} runs one model per rank (rollout.tp 1), got rollout.tp={tp}; use "
                         f"rollout.engine=vllm or sglang for rollout.tp > 1")
    if world_size is not None and world_size % tp:
        raise ValueError(f"world size {world_size} is not divisible by rollout.tp = {tp} (rollout engines are blocks of "
                         f"rollout.tp consecutive ranks); choose a divisor of {world_size}")


def rollout_blocks(world_size: int, tp: int) -> list[tuple[int, ...]]:
    """The consecutive rollout groups: blocks [k*tp, (k+1)*tp) of the world, k = the instance index."""
    check_rollout("", tp, world_size)
    return [tuple(range(start, start + tp)) for start in range(0, world_size, tp)]


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


def assign_rollout(train: ParallelLayout, rollout: RolloutLayout) -> RolloutAssignment:
    """Place rollout TP ranks on the training ranks (HybridFlow micro-DP, or consecutive blocks)."""
    G, W = rollout.tp, train.world_size
    if W % G:
        raise ValueError(f"rollout tp {G} must divide the world size {W} = tp {train.tp} x pp {train.pp} x cp {train.cp} "
                         f"x dp {train.dp}")
    q = [0] * W
    groups: list[tuple[int, ...]] = []
    if rollout.grouping == "micro_dp" and train.tp % G == 0:
        stride = train.tp // G  # q = j // stride, members of one rollout group share j % stride
        for r in range(W):
            q[r] = train.coords(r).tp // stride
        for replica in range(train.dp * train.cp):
            d, c = divmod(replica, train.cp)
            for p in range(train.pp):
                for m in range(stride):
                    groups.append(tuple(train.rank_of(p, qq * stride + m, d, c) for qq in range(G)))
    else:
        groups = rollout_blocks(W, G)
        for r in range(W):
            q[r] = r % G
    micro: dict[tuple[int, int], list[int]] = {}
    for r in range(W):
        micro.setdefault((train.replica(r), q[r]), []).append(r)
    return RolloutAssignment(tuple(q), tuple(groups), tuple(tuple(sorted(v)) for _, v in sorted(micro.items())))


def separate_assignment(train_size: int, rollout_ranks: tuple[int, ...], tp: int) -> RolloutAssignment:
    """Separate placement (megarl.async_rollout.placement): the rollout ranks, after the `train_size` training
    ranks, form engine instances of `tp` consecutive ranks. Every rank is its own micro-DP group:
    the rollout ranks hold no training shard, so each piece travels point to point from a holder."""
    if not rollout_ranks or min(rollout_ranks) < train_size:
        raise ValueError(f"rollout ranks {rollout_ranks} must follow the {train_size} training ranks")
    if len(rollout_ranks) % tp:
        raise ValueError(f"rollout tp {tp} does not divide the {len(rollout_ranks)} rollout ranks")
    world = max(rollout_ranks) + 1
    ranks = sorted(rollout_ranks)
    q = [0] * world
    groups = [tuple(ranks[i:i + tp]) for i in range(0, len(ranks), tp)]
    for group in groups:
        for position, r in enumerate(group):
            q[r] = position
    return RolloutAssignment(tuple(q), tuple(groups), tuple((r,) for r in range(world)))


def hybridflow_bytes_per_rank(model_bytes: int, train: ParallelLayout, rollout_tp: int) -> float:
    """HybridFlow's transition volume per GPU, (t*p - t_g) / (t_g * t * p) * M (p_g = 1).

    This is the lower bound when every rank's training shard is a subset of its rollout shard
    (micro-DP grouping, t_g dividing t); it ignores replicated tensors (norms), which are tiny.
    """
    tp = train.tp * train.pp
    return max(0.0, (tp - rollout_tp) / (rollout_tp * tp) * model_bytes)
