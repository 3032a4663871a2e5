"""Prompts from training DP ranks to rollout groups, and responses back.

Training: the tp*pp ranks of one model-parallel (MP) group hold the same prompts (their DP
rank's batch). Rollout: engine instances of `rollout tp` ranks (consecutive ranks for vLLM and
SGLang). Each MP rank takes a contiguous share of its batch; a rollout group all-gathers its
members' shares and every member calls `generate` on the same list (vLLM's TP ranks run in
lockstep and need identical inputs; SGLang's owner generates for the group); each rank keeps the
results of its own share; the MP group all-gathers the shares back, so every training rank ends
with the results of its whole DP batch. Requests carry their global prompt index, so seeds and
therefore samples do not depend on any of these groupings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist

from megarl.platform.process_groups import all_gather_object
from megarl.rollout.base import RolloutEngine, RolloutRequest, RolloutResult, SamplingParams


@dataclass
class DispatchGroups:
    """mp_*: this rank's training model-parallel group; rollout_*: its engine instance's group
    (rollout_rank = position in it, which all_gather_object orders by). Size-1 groups may be None.
    """

    mp_group: object | None
    mp_rank: int
    mp_size: int
    rollout_group: object | None
    rollout_rank: int
    rollout_size: int


def consecutive_rollout_group(size: int) -> tuple[object | None, list[int], int]:
    """Blocks of `size` consecutive ranks (vLLM's and SGLang's TP groups) as process groups.

    Collective: every rank calls it, and every block is created on every rank in the same order.
    Returns this rank's (group or None when size == 1, its global ranks, its position in it).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"rollout tp {size} does not divide the world size {world}")
    mine = None
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks) if size > 1 else None
        if rank in ranks:
            mine = (group, ranks, rank - start)
    return mine


def share_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of share `index` when n items are cut into `parts` contiguous, near-equal shares."""
    return n * index // parts, n * (index + 1) // parts


def generate_for_training(engine: RolloutEngine, requests: Sequence[RolloutRequest], sampling: SamplingParams,
                          groups: DispatchGroups) -> list[RolloutResult]:
    """Generate for this rank's DP batch `requests` (identical on its MP group) with every rank
    working; return all len(requests) * n results, prompt-major, on every rank of the MP group."""
    for what, group, rank, size in (("mp", groups.mp_group, groups.mp_rank, groups.mp_size),
                                    ("rollout", groups.rollout_group, groups.rollout_rank, groups.rollout_size)):
        if size > 1 and dist.get_rank(group=group) != rank:  # shares are cut by rank, gathered by group order
            raise ValueError(f"DispatchGroups.{what}_rank={rank} but this rank is {dist.get_rank(group=group)} in {what}_group")
    lo, hi = share_bounds(len(requests), groups.mp_size, groups.mp_rank)
    mine = list(requests[lo:hi])
    shares = all_gather_object(mine, groups.rollout_size, groups.rollout_group)
    flat = [r for share in shares for r in share]
    results = engine.generate(flat, sampling) if flat else []
    # this rank's share sits after the shares of the group members before it
    start = sum(len(s) for s in shares[:groups.rollout_rank]) * sampling.n
    kept = results[start:start + len(mine) * sampling.n]
    gathered = all_gather_object(kept, groups.mp_size, groups.mp_group)
    return [r for part in gathered for r in part]
