"""The Megatron engine settings of each role, read from the run config: `engine_config` (optimizer
schedule converted from trainer steps to optimizer steps, offloads, recompute, packing),
`lora_options` (a role's adapters) and `router_options` (its MoE routers). The PPO trainer, the
supervised stages and the dry run build their engines from these, so a role's engine is the same
wherever it is built."""
from __future__ import annotations

from megarl.config import Config
from megarl.engine.engine import EngineConfig, OptimConfig
from megarl.models.lora import LoraOptions
from megarl.models.moe_routing import RouterOptions


def engine_config(cfg: Config, role: str, total_steps: int, updates_per_step: int | None = None) -> EngineConfig:
    """The Megatron engine settings of one role (actor / critic / ref) from the run config.
    updates_per_step: optimizer steps per trainer step; None = the role's ppo_epochs x ppo_mini_batches
    (the supervised stages take one)."""
    if role == "ref":
        return EngineConfig(dtype=cfg.model.dtype, param_offload=bool(cfg.ref.param_offload), sequence_packing=cfg.model.sequence_packing)
    role_cfg = getattr(cfg, role)
    schedule = role_cfg.optim
    updates_per_step = updates_per_step or role_cfg.ppo_epochs * role_cfg.ppo_mini_batches
    # Schedules count trainer steps in the config (RoleOptimConfig, as verl does); Megatron's
    # scheduler counts optimizer steps (the engine's OptimConfig), so convert.
    optim = OptimConfig(lr=schedule.lr, betas=tuple(schedule.betas), weight_decay=schedule.weight_decay, eps=schedule.eps,
                        max_grad_norm=schedule.max_grad_norm, warmup_steps=schedule.warmup_steps * updates_per_step,
                        schedule=schedule.schedule, min_lr=schedule.min_lr, total_steps=total_steps * updates_per_step)
    return EngineConfig(dtype=cfg.model.dtype, optim=optim, max_tokens_per_microbatch=role_cfg.max_tokens_per_microbatch,
                        param_offload=bool(role_cfg.param_offload), grad_offload=bool(role_cfg.grad_offload),  # null = off
                        optimizer_offload=bool(role_cfg.optimizer_offload), recompute=role_cfg.recompute,
                        sequence_packing=cfg.model.sequence_packing, routing=router_options(cfg, role),
                        lora=lora_options(role_cfg.lora, f"{role}.lora", cfg.trainer.seed))


def lora_options(lora_cfg, key: str, seed: int) -> LoraOptions | None:
    """A role's `lora` section as the engine's options (None: no adapters)."""
    if lora_cfg.rank == 0:
        return None
    targets = tuple(lora_cfg.target_modules) if lora_cfg.target_modules is not None else None
    return LoraOptions(rank=lora_cfg.rank, alpha=lora_cfg.alpha, dropout=lora_cfg.dropout, target_modules=targets,
                       seed=seed, key=key)


def router_options(cfg: Config, role: str) -> RouterOptions:
    """MoE routers of a trained role: frozen if model.freeze_router; the actor's auxiliary loss and
    routing replay (megarl.models.moe_routing)."""
    if role != "actor":
        return RouterOptions(freeze=cfg.model.freeze_router)
    a = cfg.actor
    return RouterOptions(freeze=cfg.model.freeze_router, aux_loss_coeff=a.moe_aux_loss_coeff,
                         load_balancing_type=a.moe_load_balancing_type, replay=a.routing_replay)
