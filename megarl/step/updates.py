"""The update phase (phase 6 of a PPO step): which roles update at a step (`actor_updates_at`, the
critic warm-up) and each role's `train_step` over the step's record with its loss
(megarl.step.losses): ppo_epochs x ppo_mini_batches optimizer steps, then the update's metrics."""
from __future__ import annotations

from megarl.engine.engine import MegatronEngine
from megarl.step.distill import Distillation
from megarl.step.losses import actor_loss, critic_loss
from megarl.step.step_record import StepRecord, fields_of


def actor_updates_at(step: int, critic_warmup: int) -> bool:
    """trainer.critic_warmup as verl applies it (`critic_warmup <= global_steps`, steps counted from
    1): the actor's first update is at step critic_warmup; the steps before it train only the critic,
    so the actor's first advantages come from a critic that has seen critic_warmup - 1 batches."""
    return critic_warmup <= step


def update_critic(critic: MegatronEngine, record: StepRecord, critic_cfg, *, shuffle_seed: int,
                  skip_grad_norm_above: float | None) -> dict[str, float]:
    """Clipped value loss; critic.ppo_epochs x critic.ppo_mini_batches optimizer steps."""
    # for epoch in ppo_epochs: for mini_batch in ppo_mini_batches: forward/backward its micro-batches, optimizer step
    batch = record.critic_batch()
    stats = critic.train_step(batch, critic_loss(critic_cfg, record.batch.response_len), fields=fields_of(batch),
                              epochs=critic_cfg.ppo_epochs, mini_batches=critic_cfg.ppo_mini_batches,
                              shuffle_seed=shuffle_seed, skip_grad_norm_above=skip_grad_norm_above)
    critic.offload()
    return {**stats.metrics, "critic/grad_norm": _mean(stats.grad_norms), "critic/lr": critic.lr,
            "critic/skipped_steps": float(stats.skipped_steps)}


def update_actor(actor: MegatronEngine, record: StepRecord, actor_cfg, distill: Distillation | None, *, shuffle_seed: int,
                 temperature: float, banned_token_ids: tuple[int, ...], skip_grad_norm_above: float | None) -> dict[str, float]:
    """Clipped surrogate (or GSPO), dual clip, entropy bonus, KL loss; actor.ppo_epochs x
    actor.ppo_mini_batches optimizer steps. temperature, banned_token_ids: the sampled policy's."""
    # for epoch in ppo_epochs: for mini_batch in ppo_mini_batches: forward/backward its micro-batches, optimizer step
    batch = record.actor_batch(kl_loss=actor_cfg.use_kl_loss, distill_loss=distill is not None and distill.in_loss)
    stats = actor.train_step(batch, actor_loss(actor_cfg, distill, record.batch.response_len), fields=fields_of(batch),
                             epochs=actor_cfg.ppo_epochs, mini_batches=actor_cfg.ppo_mini_batches, shuffle_seed=shuffle_seed,
                             entropy=actor_cfg.entropy_coeff > 0, temperature=temperature,
                             banned_token_ids=banned_token_ids, skip_grad_norm_above=skip_grad_norm_above)
    actor.offload()
    return {**stats.metrics, "actor/grad_norm": _mean(stats.grad_norms), "actor/skipped_steps": float(stats.skipped_steps),
            **({"actor/moe_aux_loss": stats.moe_aux_loss} if stats.moe_aux_loss is not None else {})}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
