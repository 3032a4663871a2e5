"""Validation of a `Config`: ranges, enums and cross-field rules, and, given the world size, the
layout and batch-size arithmetic. Pure: nothing here reads the disk (that is megarl.config.inputs),
so a config can be validated anywhere, before any process group exists.

    sizes = validate(cfg, world_size)   # BatchSizes, printed at start-up
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

from megarl.config.placement_rules import check_placement
from megarl.config.placement_rules import training_world
from megarl.config.schema import ADV_ESTIMATORS_WITH_GROUPS, ActorConfig, Config, ConfigError, ParallelConfig, convert, hints, yaml_key
from megarl.layout import ParallelLayout, check_degrees, check_rollout


@dataclass(frozen=True)
class BatchSizes:
    """Sizes derived from the config and the world size; printed at start-up."""

    world_size: int
    dp: int
    prompts_per_dp_rank: int
    responses_per_step: int
    responses_per_dp_rank: int
    actor_responses_per_minibatch_per_dp_rank: int
    critic_responses_per_minibatch_per_dp_rank: int


def _check_lora(cfg: Config) -> None:
    """LoRA checkpoints work under every layout (megarl.engine.adapter_checkpoint describes the
    TP-split adapter factors to Megatron's checkpoint); what is left to check is the target list."""
    roles = [r for r in ("actor", "critic") if getattr(cfg, r).lora.rank > 0]
    for r in roles:
        if getattr(cfg, r).lora.target_modules == []:
            raise ConfigError(f"{r}.lora.target_modules is empty: name projections (q_proj, ...) or null for all of them")


def _check_multi_turn(cfg: Config) -> None:
    mt, ro = cfg.rollout.multi_turn, cfg.rollout
    if mt.environment is None:
        return
    if mt.max_total_tokens is not None and mt.max_total_tokens > ro.max_new_tokens:
        raise ConfigError(f"rollout.multi_turn.max_total_tokens = {mt.max_total_tokens} is above rollout.max_new_tokens = "
                          f"{ro.max_new_tokens}, the trainer's response length: raise rollout.max_new_tokens or lower it")
    if ro.tp > 1:
        raise ConfigError(f"rollout.multi_turn with rollout.tp = {ro.tp}: episodes run on each rank for its own share, which an "
                          f"engine spanning ranks does not do yet; use rollout.tp=1")
    if cfg.actor.routing_replay:
        raise ConfigError("rollout.multi_turn with actor.routing_replay: routes of observation tokens are not recorded yet; "
                          "set actor.routing_replay=false")


def validate(cfg: Config, world_size: int | None = None) -> BatchSizes | None:
    """Check values (ranges, enums, cross-field rules); with `world_size`, also the layout arithmetic.

    Files and directories named by the config are checked by `megarl.config.inputs.check_inputs`."""
    _check_bounds(cfg, "")
    a, alg, r = cfg.actor, cfg.algorithm, cfg.reward
    if not cfg.model.path:
        raise ConfigError("model.path is required (a Hugging Face model directory or hub id)")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty: give at least one Parquet file (launch/prepare_data.py)")
    if alg.adv_estimator in ADV_ESTIMATORS_WITH_GROUPS and cfg.rollout.samples_per_prompt < 2:
        raise ConfigError(f"algorithm.adv_estimator={alg.adv_estimator} needs rollout.samples_per_prompt >= 2 "
                          f"(its baseline is the other samples of the prompt), got {cfg.rollout.samples_per_prompt}")
    for name, optim in (("actor", a.optim), ("critic", cfg.critic.optim)):
        if optim.min_lr > optim.lr:
            raise ConfigError(f"{name}.optim.min_lr = {optim.min_lr} is above {name}.optim.lr = {optim.lr}")
        if not all(0 <= b < 1 for b in optim.betas):
            raise ConfigError(f"{name}.optim.betas must each be in [0, 1), got {list(optim.betas)}")
    if r.kind == "function" and (not r.function or r.function.count(":") != 1):
        raise ConfigError(f"reward.kind=function needs reward.function='module:function', got {r.function!r}")
    if r.kind == "model" and not r.model_path:
        raise ConfigError("reward.kind=model needs reward.model_path")
    if r.kind == "none" and not alg.distill.teacher_path:
        raise ConfigError("reward.kind=none scores every sample 0 and leaves nothing to learn: set "
                          "algorithm.distill.teacher_path=<teacher HF dir> (distillation alone) or pick a reward.kind")
    if r.kind == "none" and alg.filter_groups.enable:
        raise ConfigError("algorithm.filter_groups.enable drops groups whose scores are all equal, and reward.kind=none "
                          "scores every sample 0: turn one of them off")
    if alg.kl_ctrl.max_coef is not None and alg.kl_ctrl.max_coef < alg.kl_ctrl.min_coef:
        raise ConfigError(f"algorithm.kl_ctrl.max_coef = {alg.kl_ctrl.max_coef} is below "
                          f"algorithm.kl_ctrl.min_coef = {alg.kl_ctrl.min_coef}")
    if alg.filter_groups.enable and cfg.rollout.samples_per_prompt < 2:
        raise ConfigError("algorithm.filter_groups.enable drops groups whose samples all score the same, which every "
                          f"group of one sample does: set rollout.samples_per_prompt >= 2 (got {cfg.rollout.samples_per_prompt})")
    if r.overlong_buffer.len > cfg.rollout.max_new_tokens:
        raise ConfigError(f"reward.overlong_buffer.len = {r.overlong_buffer.len} is longer than rollout.max_new_tokens = "
                          f"{cfg.rollout.max_new_tokens}: the buffer is the last part of the response length limit")
    _check_unworkable(cfg)
    _check_monitoring(cfg)

    check_placement(cfg)
    _check_lora(cfg)
    _check_multi_turn(cfg)
    p = cfg.parallel
    if p.cp != 1:
        _check_context_parallel(cfg)
    try:  # the layout's own checks (megarl.layout): degrees, and the rollout engine's tp, before any model exists
        check_degrees(p.tp, p.pp, p.cp, p.ep, p.etp, p.vpp, p.first_stage_layers, p.last_stage_layers)
        check_rollout(cfg.rollout.engine, cfg.rollout.tp)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if world_size is None:
        return None

    return _check_layout(cfg, training_world(cfg, world_size))


def _check_context_parallel(cfg: Config) -> None:
    """What context parallelism (megarl.engine.context_parallel) is built for; the rest is refused here."""
    p = cfg.parallel
    if not cfg.model.sequence_packing:
        raise ConfigError(f"parallel.cp = {p.cp} needs model.sequence_packing=true (context parallelism splits packed "
                          f"sequences; Megatron's padded-input CP RoPE pins host memory, which the CPU build refuses)")
    if p.pp != 1:
        raise ConfigError(f"parallel.cp = {p.cp} with parallel.pp = {p.pp} is not built yet; use parallel.pp=1 with context parallelism")
    if cfg.actor.moe_aux_loss_coeff > 0:
        # Megatron scales the auxiliary loss's gradient by cp itself (MoEAuxLossAutoScaler), on top of
        # megarl's dp * cp loss scale: not checked against one process yet.
        raise ConfigError(f"parallel.cp = {p.cp} with actor.moe_aux_loss_coeff > 0 is not built yet; set "
                          f"actor.moe_aux_loss_coeff=0 (the RL default) with context parallelism")


def layout_of(p: ParallelConfig, world_size: int) -> ParallelLayout:
    """The torch-free layout of `parallel.*` on `world_size` ranks (ValueError with the arithmetic)."""
    return ParallelLayout.for_world(world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, vpp=p.vpp,
                                    first_stage_layers=p.first_stage_layers, last_stage_layers=p.last_stage_layers,
                                    sequence_parallel=p.sequence_parallel)


def _check_unworkable(cfg: Config) -> None:
    """Values that pass their own checks but cannot work together (issue 11): refused here rather
    than failing at the first step or being silently ignored."""
    a, alg, g = cfg.actor, cfg.algorithm, cfg.guards
    for key, kind in (("algorithm.kl_penalty", alg.kl_penalty), ("actor.kl_loss_type", a.kl_loss_type)):
        if kind == "full":
            raise ConfigError(f"{key}=full is the exact KL over the whole vocabulary, which needs the logits the trainer "
                              f"does not keep; use low_var_kl (k3), kl (k1) or mse (k2), or add + for a k2 gradient")
    if a.policy_loss == "gspo":
        default = ActorConfig()
        for key, value, base in (("actor.clip_ratio", a.clip_ratio, default.clip_ratio),
                                 ("actor.clip_ratio_c", a.clip_ratio_c, default.clip_ratio_c)):
            if value != base:
                raise ConfigError(f"{key} = {value} does not apply to actor.policy_loss=gspo (its sequence-level ratio is "
                                  f"clipped by actor.clip_ratio_low / clip_ratio_high, default 3e-4 / 4e-4, without dual clip)")
    if a.routing_replay and cfg.rollout.engine != "hf":
        raise ConfigError(f"actor.routing_replay needs the experts each token was routed to from the rollout engine; only "
                          f"rollout.engine=hf records them so far (vLLM 0.32 on GPU can return them, enable_return_routed_experts "
                          f"-> CompletionOutput.routed_experts, but megarl's {cfg.rollout.engine} adapter does not ask "
                          f"for them yet; docs/moe_routing.md): use rollout.engine=hf or actor.routing_replay=false")
    if cfg.rollout.engine == "sglang" and cfg.rollout.ignore_eos and cfg.rollout.stop_token_ids:
        raise ConfigError(f"rollout.ignore_eos with rollout.stop_token_ids = {cfg.rollout.stop_token_ids} on rollout.engine=sglang: "
                          f"SGLang 0.5.23 stops on its stop ids and the model's eos together, or with ignore_eos on neither; "
                          f"drop one of the two, or use rollout.engine=vllm or hf")
    _check_rollout_correction(cfg)
    uses_ref = alg.use_kl_in_reward or a.use_kl_loss
    if g.kl_threshold > 0 and not uses_ref:
        raise ConfigError("guards.kl_threshold > 0 but there is no KL to watch (algorithm.use_kl_in_reward and "
                          "actor.use_kl_loss are both false): set one of them, or guards.kl_threshold=0")
    if g.kl_threshold > 0 and g.kl_action == "raise_coef" and not alg.use_kl_in_reward:
        raise ConfigError("guards.kl_action=raise_coef raises the in-reward KL coefficient, but algorithm.use_kl_in_reward "
                          "is false so nothing reads it: set algorithm.use_kl_in_reward=true or guards.kl_action=skip_update")


def _check_rollout_correction(cfg: Config) -> None:
    rc = cfg.algorithm.rollout_correction
    lower = rc.rollout_rs_threshold_lower if rc.rollout_rs_threshold_lower is not None else 1 / rc.rollout_rs_threshold
    if rc.mode == "mis" and not lower < rc.rollout_rs_threshold:
        raise ConfigError(f"algorithm.rollout_correction: mis keeps sequences whose ratio lies in [rollout_rs_threshold_lower, "
                          f"rollout_rs_threshold] = [{lower}, {rc.rollout_rs_threshold}], an empty band: make the upper bound "
                          f"larger than the lower (e.g. 2.0 with lower null = 0.5)")
    if rc.mode == "icepop" and not rc.icepop_low < rc.icepop_high:
        raise ConfigError(f"algorithm.rollout_correction: icepop keeps tokens whose ratio lies in [icepop_low, icepop_high] = "
                          f"[{rc.icepop_low}, {rc.icepop_high}], an empty band: use e.g. the paper's 0.5 and 5")


def _check_monitoring(cfg: Config) -> None:
    t, run = cfg.tracking, cfg.trainer
    loggers = t.active_loggers()
    if t.mlflow is True and "mlflow" not in loggers:  # the default loggers hold mlflow: these were chosen
        raise ConfigError(f"tracking.mlflow=true (the older switch) but tracking.loggers={list(t.loggers)} has no mlflow: "
                          f"add mlflow to tracking.loggers, or drop tracking.mlflow")
    if "wandb" in loggers and "jsonl" not in loggers:
        raise ConfigError("tracking.loggers has wandb without jsonl: a resumed W&B run is rebuilt from metrics.jsonl "
                          "(so no step appears twice); add jsonl to tracking.loggers")
    if t.wandb_mode == "online" and not t.wandb_project:
        raise ConfigError("tracking.wandb_mode=online needs tracking.wandb_project (or use wandb_mode=offline)")
    bad = [s for s in run.profile_steps if not 1 <= s <= run.total_steps]
    if bad:
        raise ConfigError(f"trainer.profile_steps {bad} outside the run's steps 1..{run.total_steps} (trainer.total_steps)")


def _check_layout(cfg: Config, world_size: int) -> BatchSizes:
    p = cfg.parallel
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    try:  # ParallelDims' arithmetic, torch-free
        dp = layout_of(p, world_size).dp
        # a fleet's servers are worlds of their own (torchrun --nproc_per_node rollout.tp): no block of this one
        check_rollout(cfg.rollout.engine, cfg.rollout.tp, None if cfg.rollout.placement == "fleet" else world_size)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    model_parallel = p.tp * p.pp * p.cp
    prompts, n = cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt
    if prompts % dp:
        raise ConfigError(f"data.prompts_per_step = {prompts} is not divisible by the data-parallel size {dp} "
                          f"(world size {world_size} / (tp * pp * cp = {model_parallel}))")
    responses = prompts * n
    per_minibatch = {}
    roles = ("actor", "critic") if cfg.algorithm.adv_estimator == "gae" else ("actor",)
    for role in ("actor", "critic"):
        mini = getattr(cfg, role).ppo_mini_batches
        if role in roles and responses % (dp * mini):
            raise ConfigError(
                f"data.prompts_per_step * rollout.samples_per_prompt = {prompts} * {n} = {responses} responses per step "
                f"is not divisible by DP size * {role}.ppo_mini_batches = {dp} * {mini} = {dp * mini}")
        per_minibatch[role] = responses // (dp * mini)
    return BatchSizes(world_size=world_size, dp=dp, prompts_per_dp_rank=prompts // dp, responses_per_step=responses,
                      responses_per_dp_rank=responses // dp,
                      actor_responses_per_minibatch_per_dp_rank=per_minibatch["actor"],
                      critic_responses_per_minibatch_per_dp_rank=per_minibatch["critic"])


def _check_bounds(obj: Any, prefix: str) -> None:
    """Re-check types and enums (a Config built in code gets them too) and each field's bounds."""
    types_of = hints(type(obj))
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{yaml_key(f.name)}"
        if dataclasses.is_dataclass(value):
            _check_bounds(value, key + ".")
            continue
        convert(value, types_of[f.name], key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        for bound, ok, word in (("ge", operator.ge, ">="), ("gt", operator.gt, ">"),
                                ("le", operator.le, "<="), ("lt", operator.lt, "<")):
            if bound in f.metadata and not ok(value, f.metadata[bound]):
                raise ConfigError(f"{key} must be {word} {f.metadata[bound]}, got {value}")
