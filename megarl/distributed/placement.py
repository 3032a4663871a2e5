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

from megarl.config.schema import Config, ConfigError


def check_placement(cfg: Config) -> None:
    """Values of rollout.placement / num_ranks and async.* that cannot work (world size aside)."""
    r, a = cfg.rollout, cfg.async_
    if r.placement == "colocated":
        if r.num_ranks:
            raise ConfigError(f"rollout.num_ranks = {r.num_ranks} applies to rollout.placement=separate only; set "
                              f"rollout.placement=separate or rollout.num_ranks=0")
        if a.max_staleness or a.partial_rollout:
            raise ConfigError("async.max_staleness > 0 and async.partial_rollout need rollout ranks that keep generating while "
                              "the others train: set rollout.placement=separate and rollout.num_ranks (or async.max_staleness=0)")
        return
    if r.num_ranks < 1:
        raise ConfigError("rollout.placement=separate needs rollout.num_ranks >= 1 (the last ranks of the world generate)")
    if r.engine not in ("hf", "vllm"):
        raise ConfigError(f"rollout.placement=separate runs rollout.engine=hf or vllm so far, got {r.engine}: use one of "
                          f"those or rollout.placement=colocated")
    if r.engine == "vllm" and a.partial_rollout and r.tp > 1:
        # vLLM aborts and resubmits the running requests at an update (megarl.rollout.vllm_partial) on the
        # leading rank; its TP followers replay whole generate calls and would leave vLLM's lockstep
        raise ConfigError(f"async.partial_rollout with rollout.engine=vllm runs rollout.tp=1 engines, got rollout.tp = {r.tp}: "
                          f"set rollout.tp=1 (rollout.num_ranks engines of one rank) or async.partial_rollout=false")
    if r.num_ranks % r.tp:
        raise ConfigError(f"rollout.num_ranks = {r.num_ranks} is not divisible by rollout.tp = {r.tp}")
    if cfg.actor.routing_replay:
        # the rollout server returns tokens and log-probs only: without its routes the actor would route
        # afresh, silently not replaying
        raise ConfigError("actor.routing_replay needs the rollout's expert routes, which rollout.placement=separate does not "
                          "return yet: set actor.routing_replay=false or rollout.placement=colocated")
    alg = cfg.algorithm
    if alg.adv_estimator == "remax":
        raise ConfigError("rollout.placement=separate does not run adv_estimator=remax yet (its greedy baseline is a second "
                          "generation per step): use rollout.placement=colocated")
    if alg.filter_groups.enable and a.max_staleness:
        # dynamic sampling's rounds are generated on demand with the current weights; requests drawn
        # ahead would interleave with them in the data order (a resume would then train prompts twice)
        raise ConfigError("algorithm.filter_groups.enable generates its rounds with the current weights, not "
                          f"async.max_staleness = {a.max_staleness} steps ahead: set async.max_staleness=0 or "
                          "algorithm.filter_groups.enable=false")
    if a.partial_rollout and not a.max_staleness:
        raise ConfigError("async.partial_rollout continues requests under newer weights, which async.max_staleness=0 never "
                          "sends mid-generation: set async.max_staleness >= 1 or async.partial_rollout=false")


def training_world(cfg: Config, world_size: int) -> int:
    """The ranks that train: the whole world colocated, the world less rollout.num_ranks separate."""
    if cfg.rollout.placement != "separate":
        return world_size
    if cfg.rollout.num_ranks >= world_size:
        raise ConfigError(f"rollout.num_ranks = {cfg.rollout.num_ranks} leaves no training rank in a world of {world_size}: "
                          f"launch more processes (torchrun --nproc_per_node) or lower rollout.num_ranks")
    return world_size - cfg.rollout.num_ranks


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
    import torch.distributed as dist

    from megarl.platform import process_groups

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
    import datetime

    import torch.distributed as dist

    from megarl.platform import init_platform

    platform = init_platform()
    if not dist.is_initialized():
        dist.init_process_group(backend=platform.backend, timeout=datetime.timedelta(minutes=30))
    return split_world(Placement(world_size, training_world(cfg, world_size), cfg.rollout.tp))
