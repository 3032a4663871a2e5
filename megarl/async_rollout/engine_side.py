"""The rollout engine on the rollout ranks of separate placement, and the weight layout it loads.

vLLM's external_launcher takes the default process group as its world: constructing `LLM` is a
collective over it, and its TP groups are blocks of consecutive ranks of it. On a rollout rank the
default group is the whole world (training ranks included), so the engine is built with the
rollout ranks' own group (`WorldGroups.rollout`) as the default (`rollout_world`): vLLM's groups
and ExternalDP replicas then form over the rollout ranks alone, rollout.tp consecutive ones per
engine, and the store keys of its groups live under that group's prefix, apart from the training
ranks' Megatron groups (which live under the training group's). The engine keeps those groups;
the default group goes back to the world once it is built.

The weight layout the engine loads is decided there (vLLM's direct path on the dense families:
each rank's rollout shard with vLLM's own vocabulary rows; else full HF tensors), and the first
rollout rank sends it to every training rank, which need it for the shared reshard plan
(megarl.hybrid). Order: training rank 0 says "start" once the model directory exists, the rollout
ranks build their engines, the layout comes back, then every rank builds the plan.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from megarl.async_rollout.wire import recv_object, send_object
from megarl.distributed.parallel import RolloutGroups
from megarl.platform import current_platform, process_groups
from megarl.rollout import build_rollout


@contextlib.contextmanager
def rollout_world(groups, rank: int):
    """On a rollout rank: the rollout ranks' group as the default process group (and RANK, which
    vLLM's external_launcher reads, as this rank's place in it) for the duration (the swap itself:
    megarl.platform.process_groups.default_group)."""
    if groups.rollout is None:
        raise ValueError(f"rank {rank} is not a rollout rank")
    with process_groups.default_group(groups.rollout, rank=rank - groups.placement.train_size):
        yield


def build_engine(cfg, groups, rank: int):
    """Every rollout rank, together: its engine (rollout.tp consecutive rollout ranks per instance)
    and the layout it loads, which the first rollout rank sends to the training ranks. Returns the
    megarl.rollout.RolloutSetup, whose `groups.ranks` are global ranks."""
    placement, r = groups.placement, cfg.rollout
    recv_object(0, groups.ctrl)  # ("start",): the model directory is ready
    with rollout_world(groups, rank):
        mine = RolloutGroups.consecutive(r.tp)
        setup = build_rollout(r.engine, cfg.model.path, mine, seed=cfg.trainer.seed, device=str(current_platform().device),
                              dtype=getattr(torch, cfg.model.dtype), memory_fraction=r.gpu_memory_utilization,
                              max_model_len=cfg.data.max_prompt_tokens + r.max_new_tokens, train_tp=cfg.parallel.tp, log=None)
    setup.groups = dataclasses.replace(mine, ranks=tuple(placement.train_size + q for q in mine.ranks))
    if rank == placement.rollout_ranks[0]:
        for t in placement.train_ranks:
            send_object(("layout", setup.weight_layout, setup.weight_path, setup.weight_path_reason), t, groups.up)
    return setup


def receive_layout(groups, rank: int) -> tuple:
    """Every training rank: (weight layout, weight path, reason) of the rollout engines; rank 0 first
    tells the rollout ranks to build them."""
    placement = groups.placement
    if rank == 0:
        for r in placement.rollout_ranks:
            send_object(("start",), r, groups.ctrl)
    _, layout, path, reason = recv_object(placement.rollout_ranks[0], groups.up)
    return layout, path, reason
