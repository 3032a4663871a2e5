"""The planner's inputs from a megarl run config (YAML plus `key=value` overrides), so a run can
be sized, and checked against what the trainer measures, with the settings it runs with.

Read as plain YAML (the keys of megarl/config.py, defaults where absent). The actor's offload
and recompute settings stand for the critic's too; the reference offloads with `ref.param_offload`.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from megarl.plan.estimate import Layout, RunShape


def _get(cfg: dict, dotted: str, default):
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return default if node is None else node


def load_run_config(path: str | Path, overrides: list[str] = ()) -> dict:
    cfg = yaml.safe_load(Path(path).read_text()) or {}
    for item in overrides:
        key, _, value = item.partition("=")
        node = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return cfg


def planner_inputs(cfg: dict, **run_overrides) -> tuple[str, Layout, RunShape]:
    """(model path, Layout, RunShape) of a megarl config dict; run_overrides replace RunShape fields."""
    tp = _get(cfg, "parallel.tp", 1)
    lay = Layout(tp=tp, pp=_get(cfg, "parallel.pp", 1), vpp=_get(cfg, "parallel.vpp", 1),
                 first_stage_layers=_get(cfg, "parallel.first_stage_layers", None),
                 last_stage_layers=_get(cfg, "parallel.last_stage_layers", None),
                 ep=_get(cfg, "parallel.ep", 1), etp=_get(cfg, "parallel.etp", None),
                 cp=_get(cfg, "parallel.cp", 1), rollout_tp=_get(cfg, "rollout.tp", 1))
    alg = _get(cfg, "algorithm.adv_estimator", "gae")
    shape = dict(
        prompts_per_step=_get(cfg, "data.prompts_per_step", 256),
        samples_per_prompt=_get(cfg, "rollout.samples_per_prompt", 1),
        prompt_len=_get(cfg, "data.max_prompt_tokens", 1024),
        response_len=_get(cfg, "rollout.max_new_tokens", 1024),
        max_tokens_per_microbatch=_get(cfg, "actor.max_tokens_per_microbatch", 4096),
        ppo_epochs=_get(cfg, "actor.ppo_epochs", 1),
        critic=alg == "gae",
        ref=bool(_get(cfg, "algorithm.use_kl_in_reward", False) or _get(cfg, "actor.use_kl_loss", False)),
        recompute=_get(cfg, "actor.recompute", "none"),
        param_offload=bool(_get(cfg, "actor.param_offload", False)),
        grad_offload=bool(_get(cfg, "actor.grad_offload", False)),
        optimizer_offload="phases" if _get(cfg, "actor.optimizer_offload", False) else "none",
        dtype=_get(cfg, "model.dtype", "bfloat16"),
        gpu_memory_fraction=_get(cfg, "rollout.gpu_memory_utilization", 0.5),
    )
    shape.update(run_overrides)
    return str(_get(cfg, "model.path", "")), lay, RunShape(**shape)
