"""What the training ranks call under rollout.placement=separate: the rollout setup that stands
for a local engine (megarl.trainer), and one step's samples with the `async/` metrics
(megarl.rollout_side.remote)."""
from __future__ import annotations

import torch

from megarl.async_rollout.client import AsyncSchedule, RemoteRollout
from megarl.async_rollout.engine_side import receive_layout
from megarl.step.global_batch import LocalStats
from megarl.hybrid.transfer import identity_convert
from megarl.distributed.parallel import RolloutGroups
from megarl.rollout import RolloutSetup


def remote_setup(cfg, separate, rank: int) -> RolloutSetup:
    """A RolloutSetup whose engine is this training rank's RemoteRollout: the weight stream leaves
    in the layout the rollout engines load (they say which, megarl.async_rollout.engine_side;
    converted on the rollout rank), the dispatch group is the rank alone (its model-parallel share
    goes to its own server)."""
    layout, path, reason = receive_layout(separate, rank)
    return RolloutSetup(engine=RemoteRollout(separate, rank), weight_layout=layout,
                        groups=RolloutGroups(1, None, (rank,), 0, rank), convert=identity_convert, weight_path=path,
                        weight_path_reason=f"the last {cfg.rollout.num_ranks} ranks generate (rollout.placement=separate); {reason}")


def take_step(schedule: AsyncSchedule, step: int, data, sampling, to_samples, global_batch) -> tuple[list, dict[str, float]]:
    """This DP rank's samples of `step` (requests for the next K steps submitted first, prompts
    drawn from `data`) and the step's `async/` metrics over the global batch (one reduction)."""
    schedule.prefetch(step, data.next_step, sampling, data_state=data.state_dict)
    wait_before = schedule.remote.wait_s
    samples, stats = schedule.take(step, sampling, to_samples)
    local = LocalStats()
    local.sum("staleness_sum", torch.tensor(float(stats.staleness_sum)))
    local.sum("samples", torch.tensor(float(stats.samples)))
    local.sum("dropped", torch.tensor(float(stats.dropped)))
    local.sum("spanning", torch.tensor(float(stats.spanning)))
    local.max("staleness_max", torch.tensor(float(stats.staleness_max)))
    local.max("wait_s", torch.tensor(schedule.remote.wait_s - wait_before))
    info = schedule.remote.server_info
    local.max("sync_bytes", torch.tensor(float(info.get("sync_bytes", 0))))
    local.max("sync_full_bytes", torch.tensor(float(info.get("sync_full_bytes", 0))))
    local.max("sync_changed_fraction", torch.tensor(float(info.get("sync_changed_fraction", 1.0))))
    local.max("shard_bytes", torch.tensor(float(info.get("shard_bytes", 0))))
    local.max("busy_s", torch.tensor(float(info.get("busy_s", 0.0))))
    local.max("rollout_busy", torch.tensor(info.get("busy_s", 0.0) / max(info.get("wall_s", 0.0), 1e-9)))
    out = global_batch.reduce(local)
    samples_total = max(out["samples"], 1.0)
    return samples, {
        "async/staleness_mean": out["staleness_sum"] / samples_total,
        "async/staleness_max": out["staleness_max"],
        "async/dropped_stale": out["dropped"],
        "async/partial_fraction": out["spanning"] / samples_total,
        "async/trainer_wait_s": out["wait_s"],  # this step's wait for samples (the trainer's idle time)
        "async/rollout_busy_fraction": out["rollout_busy"],  # of the rollout rank's wall time so far
        "async/rollout_busy_s": out["busy_s"],  # the rollout rank's generating seconds so far (cumulative)
        "async/rollout_sync_bytes": out["sync_bytes"],  # received by one rollout rank in the last weight stream
        "async/rollout_sync_full_bytes": out["sync_full_bytes"],  # what a full stream brings it (rollout.weight_sync)
        "async/rollout_sync_changed_fraction": out["sync_changed_fraction"],  # of its elements, the share that changed
        "async/rollout_shard_bytes": out["shard_bytes"],  # its rollout shard: the bound (sync = shard + alignment)
    }
