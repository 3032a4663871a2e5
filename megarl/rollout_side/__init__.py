"""The rollout side of a PPO step, chosen once when the trainer is built (issue 40).

`Trainer.ppo_step` asks its rollout side for the phases of a step that touch generation and never
branches on which side it has:

    side.hand_over(step)              the actor's weights into the engine (a SyncStats)
    side.samples(step)                this DP rank's samples of the step (a StepSamples)
    side.generate(prompts, s, step)   responses under the weights just handed over (validation, ReMax)
    side.release_memory()             the engine gives its memory back before training
    side.data_state(current)          the prompt data's position a checkpoint records
    side.close()                      after the last step

The sides: `LocalRollout` (rollout.placement=colocated: the engine on the training ranks),
`FleetRollout` (fleet: servers outside the torchrun world, joining and leaving as they go, up to
async.max_staleness steps ahead),
`RemoteRolloutSide` (separate: the rollout ranks' servers, requests up to async.max_staleness
steps ahead) and `DynamicSampling` (algorithm.filter_groups: rounds of generation over either
until enough groups have a score spread). `build_rollout_side` picks them from the config; what a
side needs from the trainer it receives when built, and the trainer reads it only through these
members.
"""
from __future__ import annotations

from megarl.async_rollout.client import AsyncSchedule
from megarl.rollout.base import SamplingParams
from megarl.rollout_side.base import RolloutSide, StepSamples, WeightHandOver
from megarl.rollout_side.filtered import DynamicSampling
from megarl.rollout_side.fleet import FleetRollout
from megarl.rollout_side.local import LocalRollout
from megarl.rollout_side.remote import RemoteRolloutSide


def build_rollout_side(cfg, *, setup, engine, hand_over: WeightHandOver, dispatch, data, sampling: SamplingParams,
                       to_samples, score, global_batch, dims, separate=None) -> RolloutSide:
    """The side this config runs: local or remote by rollout.placement, inside dynamic sampling
    when algorithm.filter_groups is on."""
    episodes = cfg.rollout.multi_turn.environment is not None  # the engine runs an episode per sample
    if cfg.rollout.placement == "fleet":
        side: RolloutSide = FleetRollout(engine, setup.weight_path, hand_over, dispatch, data, sampling, to_samples,
                                         dims.world_size, cfg.async_.max_staleness, cfg.trainer.total_steps)
    elif separate is not None:
        schedule = AsyncSchedule(engine, dispatch, cfg.async_.max_staleness, cfg.trainer.total_steps)
        side = RemoteRolloutSide(engine, setup.weight_path, hand_over, dispatch, data, sampling, to_samples,
                                 schedule, global_batch, episodes)
    else:
        side = LocalRollout(engine, setup.weight_path, hand_over, dispatch, data, sampling, to_samples, episodes)
    if cfg.algorithm.filter_groups.enable:
        side = DynamicSampling(side, data, sampling, score, global_batch, prompts_per_step=cfg.data.prompts_per_step,
                               max_rounds=cfg.algorithm.filter_groups.max_num_gen_batches, dp_rank=dims.dp_rank,
                               dp_size=dims.dp)
    return side


__all__ = ["DynamicSampling", "FleetRollout", "LocalRollout", "RemoteRolloutSide", "RolloutSide", "StepSamples", "WeightHandOver",
           "build_rollout_side"]
