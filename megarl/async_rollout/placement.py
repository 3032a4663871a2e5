"""Where the rollout runs: `rollout.placement` colocated (every rank trains and generates, taking
turns) or separate (the last `rollout.num_ranks` ranks of the torchrun world only generate).

Separate placement splits the world once, right after `init_process_group`: the training ranks are
the first ones, so a training rank's rank in its own group equals its global rank, and the
training group becomes their default process group. Megatron, the engines and every
`group=None` collective of the trainer then run on the training ranks alone, unchanged. Traffic
between the two groups runs on three process groups over the whole world (`WorldGroups`: commands
and prompts, the weight stream, samples), so the rollout rank's receiving thread and its
generating thread never share a group (docs/async_rl.md).
"""
from __future__ import annotations

from dataclasses import dataclass
import datetime

from megarl.config.placement_rules import training_world
from megarl.config.schema import Config


@dataclass(frozen=True)
class Placement:
    """The world split: training ranks 0 .. train_size-1, rollout ranks train_size .. world_size-1.

    Each training rank talks to one rollout rank (round-robin), its *server*; the training ranks a
    rollout rank serves are its *clients*. With rollout_tp > 1 an engine spans rollout_tp
    consecutive rollout ranks and only its first one serves (the others follow it in lockstep)."""

    world_size: int
    train_size: int
    rollout_tp: int = 1

    def __post_init__(self):
        if not 1 <= self.train_size < self.world_size:
            raise ValueError(f"Placement: {self.train_size} training ranks in a world of {self.world_size}")

    @property
    def train_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.train_size))

    @property
    def rollout_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.train_size, self.world_size))

    def is_rollout(self, rank: int) -> bool:
        return rank >= self.train_size

    def server_of(self, train_rank: int) -> int:
        engines = len(self.rollout_ranks) // self.rollout_tp
        return self.train_size + (train_rank % engines) * self.rollout_tp

    def clients_of(self, rollout_rank: int) -> tuple[int, ...]:
        return tuple(t for t in self.train_ranks if self.server_of(t) == rollout_rank)


@dataclass
class WorldGroups:
    """Process groups over the whole world after the split: `ctrl` carries training -> rollout
    commands and prompts (received from any rank), `down` the weight stream (received from named
    ranks, so a command can never be taken for weight bytes), `up` rollout -> training samples.
    `rollout`: the rollout ranks alone (None on training ranks), the world of their engine
    (megarl.async_rollout.engine_side: vLLM's external_launcher builds its groups on it)."""

    placement: Placement
    world: object
    down: object
    up: object
    ctrl: object
    rollout: object = None


def split_world(placement: Placement) -> WorldGroups:
    """Collective over the world: make the training ranks' group their default process group.

    Rollout ranks keep the world as default (they create no groups). torch has no public way to
    run a program on a subset as if it were the world; replacing the default group is the one
    place this relies on c10d internals (megarl.platform.process_groups.set_default_group, checked by
    tests/platform/test_process_groups.py and tests/async_rl)."""
    # deferred: torch; megarl.run imports this module and stays torch-free
    import torch.distributed as dist

    from megarl.platform import process_groups  # deferred: torch (megarl.platform.process_groups imports it)

    world = process_groups.get_default_group()
    if dist.get_world_size() != placement.world_size:
        raise ValueError(f"Placement for {placement.world_size} ranks, torch.distributed has {dist.get_world_size()}")
    down = dist.new_group(list(range(placement.world_size)))
    up = dist.new_group(list(range(placement.world_size)))
    ctrl = dist.new_group(list(range(placement.world_size)))
    train = dist.new_group(list(placement.train_ranks))
    rollout = dist.new_group(list(placement.rollout_ranks))
    if not placement.is_rollout(dist.get_rank()):
        process_groups.set_default_group(train)
        rollout = None
    return WorldGroups(placement, world, down, up, ctrl, rollout)


def start(cfg: Config, world_size: int) -> WorldGroups:
    """Separate placement's start: torch.distributed over the whole world, then the split."""
    # deferred: torch; megarl.run imports this module and stays torch-free
    import torch.distributed as dist

    from megarl.platform import init_platform  # deferred: torch (megarl.platform imports it)

    platform = init_platform()
    if not dist.is_initialized():
        dist.init_process_group(backend=platform.backend, timeout=datetime.timedelta(minutes=30))
    return split_world(Placement(world_size, training_world(cfg, world_size), cfg.rollout.tp))
