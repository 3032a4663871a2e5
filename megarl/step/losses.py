"""The update phase's loss functions: `critic_loss` (the clipped value loss) and `actor_loss` (the
clipped surrogate or GSPO, dual clip, entropy bonus, KL loss, the distillation term), each built
once per update from its role's config and handed to `MegatronEngine.train_step`, which calls it
per micro-batch as loss_fn(ModelOutputs, LossBatch, Totals) -> (loss, metrics) (megarl.engine.batch);
the micro-batch's fields are read as the step record's `LossInputs`.

The math is megarl.algorithms'; this module picks the terms a config asks for, normalises by the
mini-batch totals (`Totals`: tokens and sequences over the data-parallel mini-batch) and reports
each term per micro-batch token (`local_loss_value`), on the device: no host sync per micro-batch."""
from __future__ import annotations

import torch

from megarl import algorithms as A
from megarl.engine.batch import LossBatch, LossFn, ModelOutputs, Totals
from megarl.step.distill import Distillation
from megarl.step.step_record import LossInputs


def critic_loss(critic_cfg, response_len: int) -> LossFn:
    """Clipped value loss (critic.vf_clip), aggregated by critic.loss_agg_mode."""

    def loss_fn(o: ModelOutputs, mb: LossBatch, t: Totals):
        x = LossInputs.of(mb)
        values, old_values, returns = need(o.values, "values"), need(x.old_values, "old_values"), need(x.returns, "returns")
        loss, metrics = A.value_loss(values, old_values, returns, x.response_mask, critic_cfg.vf_clip,
                                     agg=critic_cfg.loss_agg_mode, **agg_totals(t, critic_cfg.loss_agg_mode, response_len))
        return loss, {**metrics, "critic/vf_loss": local_loss_value(loss, t, x)}

    return loss_fn


def actor_loss(actor_cfg, distill: Distillation | None, response_len: int) -> LossFn:
    """Clipped surrogate (or GSPO under actor.policy_loss=gspo), dual clip, minus the entropy bonus,
    plus the KL loss (actor.use_kl_loss) and the reverse KL to the teacher (algorithm.distill.mode=loss;
    `distill`: the run's Distillation or None)."""
    agg_mode = actor_cfg.loss_agg_mode
    clip_low = actor_cfg.clip_ratio_low if actor_cfg.clip_ratio_low is not None else actor_cfg.clip_ratio
    clip_high = actor_cfg.clip_ratio_high if actor_cfg.clip_ratio_high is not None else actor_cfg.clip_ratio

    def loss_fn(o: ModelOutputs, mb: LossBatch, t: Totals):
        x = LossInputs.of(mb)
        mask = x.response_mask
        agg = agg_totals(t, agg_mode, response_len)
        logprobs, old, advantages = need(o.logprobs, "logprobs"), need(x.old_logprobs, "old_logprobs"), need(x.advantages, "advantages")
        if actor_cfg.policy_loss == "gspo":
            # GSPO clips a sequence-level ratio: its own bounds (clip_ratio_low/high, GSPO's 3e-4 / 4e-4
            # when unset); PPO's clip_ratio and dual clip do not apply (validation refuses them)
            pg_loss, metrics = A.gspo_policy_loss(logprobs, old, advantages, mask, agg=agg_mode,
                                                  rollout_is_weights=x.rollout_is_weights, **gspo_clip(actor_cfg), **agg)
        else:
            pg_loss, metrics = A.policy_loss(logprobs, old, advantages, mask,
                                             clip_ratio_low=clip_low, clip_ratio_high=clip_high,
                                             clip_ratio_c=actor_cfg.clip_ratio_c, agg=agg_mode,
                                             rollout_is_weights=x.rollout_is_weights, **agg)
        loss = pg_loss
        metrics = {**metrics, "actor/pg_loss": local_loss_value(pg_loss, t, x)}
        if actor_cfg.entropy_coeff > 0:
            entropy = A.agg_loss(need(o.entropy, "entropy"), mask, agg_mode, **agg)
            loss = loss - actor_cfg.entropy_coeff * entropy
        if actor_cfg.use_kl_loss:
            kl = A.agg_loss(A.kl_penalty(logprobs, need(x.ref_logprobs, "ref_logprobs"), actor_cfg.kl_loss_type), mask, agg_mode, **agg)
            loss = loss + actor_cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = local_loss_value(kl, t, x)
        if distill is not None and distill.in_loss:  # algorithm.distill.mode=loss: the reverse KL to the teacher (megarl.step.distill)
            rkl = need(distill.loss(logprobs, need(x.teacher_logprobs, "teacher_logprobs"), mask, agg_mode, **agg), "distill loss")
            loss = loss + distill.coef * rkl
            metrics["actor/distill_loss"] = local_loss_value(rkl, t, x)
        return loss, metrics

    return loss_fn


def need(t: torch.Tensor | None, name: str) -> torch.Tensor:
    """A term the configured loss reads; missing only when the update's batch was built without it
    (a wiring bug, named here instead of failing inside the math)."""
    if t is None:
        raise RuntimeError(f"the loss needs {name}, which this micro-batch or forward does not carry")
    return t


def gspo_clip(actor_cfg) -> dict:
    """actor.clip_ratio_low / clip_ratio_high when set; otherwise gspo_policy_loss's defaults."""
    return {k: v for k, v in (("clip_ratio_low", actor_cfg.clip_ratio_low), ("clip_ratio_high", actor_cfg.clip_ratio_high))
            if v is not None}


def agg_totals(totals: Totals, mode: str, response_len: int) -> dict:
    """The mini-batch totals a loss aggregation divides by (seq-mean-token-sum-norm: by response_len too)."""
    return {"global_tokens": totals.tokens, "global_seqs": totals.seqs,
            "loss_scale_factor": float(response_len) if mode == "seq-mean-token-sum-norm" else None}


def local_loss_value(loss: torch.Tensor, totals: Totals, inputs: LossInputs) -> torch.Tensor:
    """A micro-batch's loss contribution expressed per token of the micro-batch, so that the
    engine's token-weighted average over micro-batches gives back the mini-batch loss. A float64
    tensor (no host sync; the engine reads the step's metrics once): the same arithmetic as in floats.
    The token count is the micro-batch's, counted on the host when it was built."""
    return loss.detach().double() * float(totals.tokens) / max(inputs.response_tokens, 1.0)
