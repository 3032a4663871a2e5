"""The metrics of one PPO step, from the step's results: what each rank holds is collected into one
`LocalStats` (`local_stats`), reduced over the data-parallel ranks in one collective by
`GlobalBatch.reduce`, and named here (`step_metrics`, a pure function). Names follow verl's
(critic/score/mean, actor/pg_loss, response_length/clip_ratio, ...) so dashboards carry over.
"""
from __future__ import annotations

import torch

from megarl.step.global_batch import LocalStats


def local_stats(*, scores: torch.Tensor, token_rewards: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                returns: torch.Tensor, entropy: torch.Tensor, prompt_tokens: int, max_new_tokens: int,
                rollout_prob_diff: torch.Tensor, old_values: torch.Tensor | None,
                samples_per_prompt: int = 1, overlong_from: int | None = None) -> LocalStats:
    """This rank's partial statistics; every tensor is [m] or [m, R] over this rank's m samples,
    mask the [m, R] response mask. rollout_prob_diff: |p_rollout - p_actor| per token (verl's
    training/rollout_probs_diff). The samples are prompt-major, samples_per_prompt per prompt (a rank
    holds whole groups); overlong_from: the length past which
    DAPO's overlong penalty applies (None: off)."""
    stats = LocalStats()
    stats.mean("critic/score/mean", scores)
    stats.max("critic/score/max", scores)
    stats.min("critic/score/min", scores)
    stats.mean("critic/rewards/mean", (token_rewards * mask).sum(-1))
    stats.masked_mean("critic/advantages/mean", advantages, mask)
    stats.masked_mean("critic/returns/mean", returns, mask)
    stats.masked_mean("actor/entropy", entropy, mask)
    response_len = mask.sum(-1)
    stats.mean("response_length/mean", response_len.float())
    stats.mean("response_length/clip_ratio", (response_len >= max_new_tokens).float())
    stats.masked_mean("training/rollout_probs_diff_mean", rollout_prob_diff, mask)
    stats.max("training/rollout_probs_diff_max", rollout_prob_diff.reshape(-1))
    stats.sum("tokens", mask.sum() + torch.tensor(float(prompt_tokens)))
    stats.sum("response_tokens", mask.sum())
    stats.sum("samples", torch.tensor(float(len(scores))))
    if old_values is not None:
        stats.masked_mean("critic/values/mean", old_values, mask)
    if samples_per_prompt > 1:
        # trained groups whose samples all score the same: no GRPO/RLOO signal (0 under dynamic sampling)
        grouped = scores.reshape(-1, samples_per_prompt)
        stats.sum("train/uniform_groups", (grouped.max(-1).values == grouped.min(-1).values).float())
    if overlong_from is not None:
        stats.sum("reward/overlong_penalised", (response_len > overlong_from).float())
    return stats


def step_metrics(*, batch_stats: dict[str, float], update: dict[str, float], reward_kl: float, kl_coef: float,
                 actor_lr: float, sync_bytes: int, sync_peak_bytes: int, dropped_prompts: int,
                 sync_full_bytes: int = 0, sync_changed_fraction: float = 1.0,
                 bytes_moved: dict[str, int], memory: dict[str, float], resident: dict[str, float],
                 timing: dict[str, float], world_size: int, explained_var: float | None,
                 guard_events: list[tuple[str, dict]]) -> dict[str, float]:
    """The step's metrics dict (identical on every rank: every input is already global or
    rank-independent, except the per-rank memory figures)."""
    metrics = dict(update)
    metrics.update({
        "critic/score/mean": batch_stats["critic/score/mean"],
        "critic/score/max": batch_stats["critic/score/max"],
        "critic/score/min": batch_stats["critic/score/min"],
        "critic/rewards/mean": batch_stats["critic/rewards/mean"],
        "critic/advantages/mean": batch_stats["critic/advantages/mean"],
        "critic/returns/mean": batch_stats["critic/returns/mean"],
        "actor/entropy": batch_stats["actor/entropy"],
        "actor/reward_kl_penalty": reward_kl,
        "actor/reward_kl_penalty_coeff": float(kl_coef),
        "actor/lr": actor_lr,
        "response_length/mean": batch_stats["response_length/mean"],
        "response_length/clip_ratio": batch_stats["response_length/clip_ratio"],
        "training/hybrid_sync_bytes": float(sync_bytes),
        # rollout.weight_sync: what a full sync receives (the bound beside the bytes) and the share of
        # the received elements that changed since the last sync (1 on a full sync; docs/rollout.md)
        "training/hybrid_sync_full_bytes": float(sync_full_bytes),
        "training/hybrid_sync_changed_fraction": float(sync_changed_fraction),
        "training/hybrid_sync_peak_bytes": float(sync_peak_bytes),
        "training/data_dropped_prompts": float(dropped_prompts),
        **{f"perf/{kind}_bytes": float(moved) for kind, moved in bytes_moved.items()},
        **memory,
        **resident,
        "training/rollout_probs_diff_mean": batch_stats["training/rollout_probs_diff_mean"],
        "training/rollout_probs_diff_max": batch_stats["training/rollout_probs_diff_max"],
        **timing,
    })
    for name in ("train/uniform_groups", "reward/overlong_penalised"):
        if name in batch_stats:
            metrics[name] = batch_stats[name]
    if "critic/values/mean" in batch_stats:
        metrics["critic/values/mean"] = batch_stats["critic/values/mean"]
        metrics["critic/vf_explained_var"] = explained_var
    step_time = sum(timing.values())
    metrics["timing_s/step"] = step_time
    metrics["perf/throughput"] = batch_stats["tokens"] / max(step_time, 1e-9) / world_size
    metrics["perf/total_num_tokens"] = batch_stats["tokens"]
    # Rollout throughput: the step's generated tokens over the generation phase (every rank
    # generates at once, so its own gen time is the phase's), for the whole job and per GPU.
    gen_time = max(timing.get("timing_s/gen", 0.0), 1e-9)
    metrics["perf/rollout_tokens_per_s"] = batch_stats["response_tokens"] / gen_time
    metrics["perf/rollout_tokens_per_s_per_gpu"] = batch_stats["response_tokens"] / gen_time / world_size
    metrics["perf/samples_per_s"] = batch_stats["samples"] / max(step_time, 1e-9)
    for name, _ in guard_events:  # each guard firing is a metric as well as an event
        metrics[name] = metrics.get(name, 0.0) + 1.0
    return metrics
