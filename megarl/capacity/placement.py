"""Step time of the two rollout placements and of the asynchronous schedule, from phase costs.

Input: the colocated step's phase times on all G GPUs (`estimate.step_time`: generation, the
training phases, the weight sync), the model's bytes and the link. With separate placement, R
GPUs generate and G - R train; each phase's work is the same, spread over fewer GPUs (generation
x G / R, training x G / (G - R)), and the weight stream sends each rollout GPU its rollout shard
(model bytes / rollout tp) across the groups. Then:

    colocated (sync):  sync + gen + train                 (every GPU does each phase in turn)
    separate, K = 0:   sync_sep + gen_sep + train_sep     (each group waits for the other)
    separate, K >= 1:  max(gen_sep, train_sep + sync_sep) (generation of step s+1 overlaps training
                       of step s; the trainer still pays the weight stream)

Idle fraction of a group = 1 - its busy time / step time. The estimate ignores the generation
tail (every response as long as the longest) and memory (a rollout GPU holds the engine only).
"""
from __future__ import annotations

TRAIN_PHASES = ("old_log_prob", "ref", "values", "update_critic", "update_actor")


def placement_times(phases: dict, gpus: int, rollout_gpus: int, model_bytes: float, rollout_tp: int, link_bytes_per_s: float,
                    max_staleness: int = 1) -> dict:
    """Seconds per step and idle fractions of colocated, separate-sync and separate-async.

    phases: the colocated step's seconds by phase (keys of estimate.step_time: sync, gen, and the
    training phases). rollout_gpus: R of the `gpus`; a multiple of rollout_tp, fewer than gpus."""
    if not 0 < rollout_gpus < gpus:
        raise ValueError(f"--rollout-gpus must be between 1 and {gpus - 1} (the others train), got {rollout_gpus}")
    if rollout_gpus % rollout_tp:
        raise ValueError(f"--rollout-gpus {rollout_gpus} is not a multiple of --rollout-tp {rollout_tp}")
    gen, train = phases["gen"], sum(phases.get(k, 0.0) for k in TRAIN_PHASES)
    colocated = phases["sync"] + gen + train
    gen_sep = gen * gpus / rollout_gpus
    train_sep = train * gpus / (gpus - rollout_gpus)
    sync_sep = model_bytes / rollout_tp / link_bytes_per_s
    sep_sync = sync_sep + gen_sep + train_sep
    sep_async = max(gen_sep, train_sep + sync_sep) if max_staleness >= 1 else sep_sync

    def idle(busy: float, step: float) -> float:
        return round(max(0.0, 1.0 - busy / step), 4)

    return {
        "rollout_gpus": rollout_gpus, "train_gpus": gpus - rollout_gpus, "max_staleness": max_staleness,
        "colocated_sync_s": round(colocated, 3),
        "separate_sync_s": round(sep_sync, 3),
        "separate_async_s": round(sep_async, 3),
        "separate_async_over_separate_sync": round(sep_sync / sep_async, 3),
        "separate_async_over_colocated_sync": round(colocated / sep_async, 3),
        "separate_gen_s": round(gen_sep, 3), "separate_train_s": round(train_sep, 3), "separate_sync_stream_s": round(sync_sep, 3),
        "idle_fraction": {"separate_sync": {"rollout": idle(gen_sep, sep_sync), "train": idle(train_sep + sync_sep, sep_sync)},
                          "separate_async": {"rollout": idle(gen_sep, sep_async), "train": idle(train_sep + sync_sep, sep_async)}},
    }


def best_split(phases: dict, gpus: int, model_bytes: float, rollout_tp: int, link_bytes_per_s: float, max_staleness: int = 1) -> dict:
    """The rollout GPU count (a multiple of rollout_tp) with the shortest asynchronous step."""
    options = [placement_times(phases, gpus, r, model_bytes, rollout_tp, link_bytes_per_s, max_staleness)
               for r in range(rollout_tp, gpus, rollout_tp)]
    if not options:
        raise ValueError(f"no rollout split of {gpus} GPUs in multiples of rollout tp {rollout_tp} leaves a training GPU")
    return min(options, key=lambda o: (o["separate_async_s"], o["rollout_gpus"]))
