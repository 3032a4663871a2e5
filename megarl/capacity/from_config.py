"""The planner's inputs from a megarl run config (YAML plus `key=value` overrides), so a run can
be sized, and checked against what the trainer measures, with the settings it runs with.

The config is read by `megarl.config.load_config`, the trainer's own reader: the schema's defaults
fill what the file omits, unknown keys and bad values are refused the same way. The actor's
offload and recompute settings stand for the critic's too; the reference offloads with
`ref.param_offload`.
"""
from __future__ import annotations

from pathlib import Path

from megarl.config import Config, load_config
from megarl.capacity.estimate import Layout, RunShape


def load_run_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """The run's `Config` (ConfigError, a ValueError, for a bad file, key or value)."""
    return load_config(str(path), list(overrides))


def planner_inputs(cfg: Config, **run_overrides) -> tuple[str, Layout, RunShape]:
    """(model path, Layout, RunShape) of a megarl Config; run_overrides replace RunShape fields."""
    p, a, r = cfg.parallel, cfg.actor, cfg.rollout
    lay = Layout(tp=p.tp, pp=p.pp, vpp=p.vpp or 1, first_stage_layers=p.first_stage_layers,
                 last_stage_layers=p.last_stage_layers, ep=p.ep, etp=p.etp, cp=p.cp, rollout_tp=r.tp,
                 sequence_parallel=p.sequence_parallel)
    shape = dict(
        prompts_per_step=cfg.data.prompts_per_step,
        samples_per_prompt=r.samples_per_prompt,
        prompt_len=cfg.data.max_prompt_tokens,
        response_len=r.max_new_tokens,
        max_tokens_per_microbatch=a.max_tokens_per_microbatch,
        ppo_epochs=a.ppo_epochs,
        critic=cfg.algorithm.adv_estimator == "gae",
        ref=bool(cfg.algorithm.use_kl_in_reward or a.use_kl_loss),
        recompute=a.recompute,
        param_offload=a.param_offload,
        grad_offload=a.grad_offload,
        optimizer_offload="phases" if a.optimizer_offload else "none",
        dtype=cfg.model.dtype,
        gpu_memory_fraction=r.gpu_memory_utilization,
        lora_rank=a.lora.rank,
        weight_sync=r.weight_sync.mode,
    )
    shape.update(run_overrides)
    return cfg.model.path, lay, RunShape(**shape)
