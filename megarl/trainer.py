"""The PPO trainer: `Trainer.train` owns the loop and `Trainer.ppo_step` reads top to bottom like
the algorithm box of a paper.

    train: for step in step+1 .. total_steps:
        ppo_step:
            1 sync        actor weights -> rollout engine (3D-HybridEngine, bucketed)
            2 generate    n samples per prompt, seeded by (seed, step, prompt, sample) -> Sample records
            3 score       old log-probs (+ entropy), reference log-probs, values, teacher log-probs
            4 rewards     reward function, KL in the reward, the distillation term (algorithm.distill)
            5 advantages  GAE / GRPO / RLOO / REINFORCE++ / ReMax over the *global* batch
            6 update      critic (clipped value loss), then actor (clipped surrogate, dual-clip, KL,
                          entropy), each ppo_epochs x ppo_mini_batches optimizer steps
            7 control     KL controller, batch statistics in one reduction, guards, metrics
        validate, log metrics and guard events, checkpoint (state_dict / load_state_dict)

All ranks run this same program (SPMD). Each data-parallel rank owns prompts_per_step / dp prompts
and their samples; quantities defined over the whole batch (advantage whitening, group baselines,
the KL controller's input) are computed on the all-gathered batch, so every layout computes the
same numbers.

What a step computes travels in typed, immutable records (megarl.step.step_record: Scores, Correction,
StepRecord; the engines return ModelOutputs and call the losses with typed micro-batches,
megarl.engine.batch), built once by the phase that computes them.

The rollout side (colocated, separate, dynamic sampling around either) is chosen once, when the
trainer is built (megarl.rollout_side.build), so `ppo_step` reads as the phases of a step whatever
the variant. The Trainer builds the engines, owns the loop and its state, and calls the phases'
pieces in megarl.step: engine settings (engine_options), sample scoring (scoring), advantages,
losses and updates, the phase clock and memory metrics; the weight-sync check is
megarl.hybrid.sync_check's.
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from megarl import algorithms as A
from megarl.checkpointing import checkpoint
from megarl.config import Config
from megarl.data.dataset import PromptDataset, PromptRow
from megarl.data.tokenizer import load_tokenizer
from megarl.distributed.parallel import ParallelDims
from megarl.engine.engine import MegatronEngine
from megarl.hybrid.sync_check import WeightSyncCheck
from megarl.hybrid.verify import token_prob_diff
from megarl.platform.process_groups import all_gather_object
from megarl.rewards import build_reward_fn
from megarl.rewards.model import RewardModel
from megarl.rollout.base import SamplingParams
from megarl.rollout.multi_turn import episode_metrics
from megarl.rollout_side import StepSamples
from megarl.rollout_side.build import build_trainer_rollout
from megarl.runtime import heartbeat
from megarl.runtime.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionWatch
from megarl.runtime.profiling import StepProfiler
from megarl.step import rollout_corr
from megarl.step.advantages import compute_advantages, remax_baseline, scores_at_last_token
from megarl.step.distill import build_distillation
from megarl.step.engine_options import engine_config
from megarl.step.global_batch import GlobalBatch
from megarl.step.guards import Guards
from megarl.step.memory_metrics import bytes_moved, process_memory_metrics, resident_bytes, resident_metrics
from megarl.step.phase_clock import PhaseClock
from megarl.step.samples import RolloutBatch, Sample, id_records, merge_id_records, to_rollout_batch
from megarl.step.scoring import SampleScorer, to_samples
from megarl.step.step_metrics import local_stats, step_metrics
from megarl.engine.batch import ModelOutputs
from megarl.step.step_record import Scores, StepRecord, StepResult
from megarl.step.updates import actor_updates_at, update_actor, update_critic


class Trainer:
    def __init__(self, cfg: Config, dims: ParallelDims, log=print, separate=None):
        """separate: the world split of rollout.placement=separate (megarl.async_rollout.placement.WorldGroups);
        the rollout then runs on the rollout ranks (megarl.async_rollout)."""
        self.cfg, self.dims, self.log, self.separate = cfg, dims, log, separate
        self.global_batch = GlobalBatch(dims)
        t = cfg.trainer
        self.profiler = StepProfiler(t.profiler, t.profile_steps, t.run_dir, dims.rank)  # refuses nvtx without CUDA first
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.data = PromptDataset(
            cfg.data.train_files, prompts_per_step=cfg.data.prompts_per_step, dp_rank=dims.dp_rank, dp_size=dims.dp,
            seed=t.seed, shuffle=cfg.data.shuffle, prompt_key=cfg.data.prompt_key,
            ground_truth_key=cfg.data.ground_truth_key, tokenizer=self.tokenizer,
            max_prompt_tokens=cfg.data.max_prompt_tokens, apply_chat_template=cfg.data.apply_chat_template,
            log=log if dims.rank == 0 else (lambda _: None))
        reward_model = None
        if cfg.reward.kind == "model":
            reward_model = RewardModel(cfg.reward.model_path, dims, dtype=cfg.model.dtype,
                                       sequence_packing=cfg.model.sequence_packing)
        # the score of a sample: reward function, environment, overlong penalty (megarl.step.scoring)
        self.score = SampleScorer(build_reward_fn(cfg.reward, reward_model), cfg.reward.overlong_buffer, cfg.rollout.max_new_tokens)

        alg = cfg.algorithm
        self.uses_critic = alg.adv_estimator == "gae"
        self.uses_ref = alg.use_kl_in_reward or cfg.actor.use_kl_loss
        self.actor = MegatronEngine(cfg.model.path, dims, engine_config(cfg, "actor", t.total_steps), seed=t.seed)
        self.critic = (MegatronEngine(cfg.critic.model_path or cfg.model.path, dims, engine_config(cfg, "critic", t.total_steps), value_head=True, seed=t.seed)
                       if self.uses_critic else None)
        # Under actor.lora the reference policy is the actor with its adapters off: no second model.
        self.ref_from_actor = self.uses_ref and cfg.actor.lora.rank > 0 and not cfg.ref.separate_model
        self.ref = (MegatronEngine(cfg.model.path, dims, engine_config(cfg, "ref", t.total_steps), trainable=False)
                    if self.uses_ref and not self.ref_from_actor else None)
        # algorithm.distill: a teacher built as the reference is, scoring the samples (megarl.step.distill)
        teacher = (MegatronEngine(alg.distill.teacher_path, dims, engine_config(cfg, "ref", t.total_steps), trainable=False)
                   if alg.distill.teacher_path else None)
        self.distill = build_distillation(alg.distill, teacher, self.actor, cfg.model.path, self.global_batch) if teacher else None
        kl_cfg = alg.kl_ctrl
        # The KL coefficient's one writer: the controller (its update, and raise_coef for the KL guard).
        self.kl_ctrl = (A.AdaptiveKLController(kl_cfg.kl_coef, kl_cfg.target_kl, kl_cfg.horizon,
                                               min_kl_coef=kl_cfg.min_coef, max_kl_coef=kl_cfg.max_coef)
                        if kl_cfg.type == "adaptive" else A.FixedKLController(kl_cfg.kl_coef, max_kl_coef=kl_cfg.max_coef))

        # the rollout side, chosen here (megarl.rollout_side.build): engine, weight hand-over, sampling parameters
        self._say_moe_aux_loss(cfg)
        self.rollout, self.sampling = build_trainer_rollout(
            cfg, dims, self.actor, self.tokenizer, self.data, offload=self._offload_all, to_samples=partial(to_samples, self.tokenizer),
            score=self.score, global_batch=self.global_batch, separate=separate, log=log if dims.rank == 0 else None)
        self.val_data = None
        if t.val_every_steps and cfg.data.val_files:
            self.val_data = PromptDataset(
                cfg.data.val_files, prompts_per_step=cfg.data.prompts_per_step, dp_rank=dims.dp_rank, dp_size=dims.dp,
                seed=t.seed, shuffle=False, prompt_key=cfg.data.prompt_key, ground_truth_key=cfg.data.ground_truth_key,
                tokenizer=self.tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens,
                apply_chat_template=cfg.data.apply_chat_template, log=lambda _: None)
        self.guards = Guards(cfg.guards)
        self.step = 0  # PPO steps completed
        # rollout.verify_weights: the first weight-sync check of this process is fatal, later ones a guard
        self.sync_check = WeightSyncCheck(cfg.rollout, cfg.model.dtype, self.actor.spec.family, self.global_batch, log, dims.rank)
        self.trained_ids: list | None = None  # tracking.sample_ids: the last step's trained samples (id_records)

    def _say_moe_aux_loss(self, cfg: Config) -> None:
        """The MoE auxiliary loss, when on, is said once."""
        if cfg.actor.moe_aux_loss_coeff > 0 and self.dims.rank == 0:
            self.log(f"megarl: MoE auxiliary load-balancing loss on in the actor: {cfg.actor.moe_load_balancing_type}, "
                     f"coefficient {cfg.actor.moe_aux_loss_coeff} (metric actor/moe_aux_loss)")

    # --- the loop and its state ---------------------------------------------------------------------
    def train(self, tracker, watch: PreemptionWatch) -> None:
        """Steps step+1 .. trainer.total_steps: PPO step, validation, metrics and guard events to
        the tracker, checkpoints; after a step in which `watch` (installed by megarl.run.Run) caught
        SIGTERM / SIGUSR1 on any rank, its checkpoint and Preempted. Collective: every rank calls it."""
        run = self.cfg.trainer
        while self.step < run.total_steps:
            self.step += 1
            heartbeat.enter("step", self.step)
            last = self.step == run.total_steps
            with self.profiler.step(self.step):
                metrics, events = self.ppo_step()
            if self.val_data is not None and (self.step % run.val_every_steps == 0 or last):
                heartbeat.enter("validate")
                metrics.update(self.validate())
            tracker.log(metrics, step=self.step)
            if self.trained_ids is not None:
                tracker.samples(self.step, self.trained_ids)
            for name, fields in events:
                tracker.event(name, step=self.step, **fields)
            saved = bool(run.save_every_steps and (self.step % run.save_every_steps == 0 or last))
            if saved:
                heartbeat.enter("save")
                checkpoint.save(self, run.run_dir, self.step, keep_last=run.keep_last_checkpoints)
            if not last and (signame := watch.agreed()):
                if not saved:
                    heartbeat.enter("save")
                    checkpoint.save(self, run.run_dir, self.step, keep_last=run.keep_last_checkpoints)
                if self.dims.rank == 0:
                    self.log(f"megarl: {signame}: stopped after step {self.step} with its checkpoint; exit code "
                             f"{PREEMPTED_EXIT_CODE}, the same command resumes (trainer.resume=auto)")
                watch.keep_until_exit = True  # a late signal (torchrun's, to the others) must not cut the exit short
                raise Preempted(self.step, signame)
        self.rollout.close()

    def resume(self, start: Path) -> None:
        """Load the checkpoint `start` (megarl.run.Run decides which) into the engines and this trainer."""
        checkpoint.restore(self, start)

    def checkpointed_engines(self) -> dict[str, MegatronEngine]:
        """The engines a checkpoint holds, by directory name (the reference is frozen: not saved)."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def state_dict(self) -> dict:
        """The run state beside the engines' weights and optimizers (trainer.pt of a checkpoint)."""
        data = self.data.state_dict()  # separate placement: before the prompts in flight (megarl.async_rollout)
        return {"step": self.step, "kl_ctrl": self.kl_ctrl.state_dict(),
                "data": self.rollout.data_state(data),
                "guards": self.guards.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        # Checkpoints written before this version also hold "lr_scale", which nothing read: ignored.
        self.step = state["step"]
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.data.load_state_dict(state["data"])
        self.guards.load_state_dict(state["guards"])

    # ------------------------------------------------------------------------------------------
    def ppo_step(self) -> StepResult:
        """One PPO iteration (step number self.step); returns the step's metrics (identical on every
        rank) and the guard events that fired."""
        cfg, alg, timing, resident = self.cfg, self.cfg.algorithm, {}, {}
        clock = PhaseClock(timing, after=lambda name: resident.update({name: resident_bytes(self._engines())}))
        moved_before = bytes_moved(self._engines())

        # 1. Sync: the actor's current weights into the rollout engine; training state out of its
        # way; only then the engine's KV cache (so it can use the memory training held).
        with clock("timing_s/sync"):
            sync = self.rollout.hand_over(self.step)

        # 2. Generate samples_per_prompt responses to this rank's prompts (with DAPO's dynamic
        # sampling: rounds of prompts until prompts_per_step groups have a score spread, scored).
        # ReMax's baseline, one greedy response per prompt, comes from the same weights and must be
        # generated before release_memory(): vLLM (sleep level 2) and SGLang drop the weights there.
        with clock("timing_s/gen"):
            generated = self.rollout.samples(self.step)
            samples = generated.samples
            greedy = (self.rollout.generate(_first_of_groups(samples, self.sampling.n), self._greedy, self.step)
                      if alg.adv_estimator == "remax" else None)
            self.rollout.release_memory()
        if cfg.tracking.sample_ids:  # every rank's share, for rank 0's samples.jsonl
            self.trained_ids = merge_id_records(all_gather_object(id_records(samples), self.dims.world_size, None))
        rollout_batch = to_rollout_batch(samples, self.sampling.n, self.sampling.max_new_tokens)
        batch, mask = rollout_batch.batch, rollout_batch.batch.response_mask
        episodes = episode_metrics(samples, self.rollout.engine, self.global_batch.reduce)  # {} without rollout.multi_turn

        # 3. Score the samples with the models: old log-probs (+ entropy), reference log-probs, values.
        with clock("timing_s/old_log_prob"):
            # The policy is the distribution the engine sampled: logits / temperature over the
            # vocabulary without rollout.banned_token_ids, for the actor (old and current) and the reference.
            old = self.actor.forward_only(batch, entropy=True, temperature=self.sampling.temperature,
                                          banned_token_ids=self.sampling.banned_token_ids)
        sync_check = (self.sync_check(self.step, rollout_batch, old.logprobs, mask)
                      if generated.current_weights else StepResult({}, []))  # stale samples differ
        # algorithm.rollout_correction: importance weights / rejection between the engine's log-probs
        # (behaviour) and the old log-probs (proximal), for the actor's loss (megarl.step.rollout_corr)
        correction = rollout_corr.apply(alg.rollout_correction, old.logprobs, rollout_batch.rollout_logprobs, mask,
                                        rollout_batch.logprobs_are_scaled, self.global_batch)
        scored = self._score_with_models(batch, old, clock)

        # 4. Rewards: the reward function's score on the last response token, minus the KL penalty
        # (plus the teacher's per-token term under algorithm.distill.mode=reward).
        with clock("timing_s/reward"):
            scores, token_rewards, advantage_scores, reward_kl = self._rewards(generated, scored, mask)

        # 5. Advantages and returns over the global batch.
        with clock("timing_s/adv"):
            baseline = remax_baseline(self.score(greedy), self.sampling.n) if greedy is not None else None
            advantages, returns = compute_advantages(alg, self.global_batch, rollout_batch, advantage_scores, token_rewards,
                                                     scored.values, baseline)
        record = StepRecord(batch=batch, response_mask=mask, scored=scored, scores=scores,
                            token_rewards=token_rewards, advantages=advantages, returns=returns, correction=correction)

        # 6. Update: critic, then actor; each runs ppo_epochs x ppo_mini_batches optimizer steps.
        update, before = self._update(record, reward_kl, clock)

        # 7. Control: KL controller, batch statistics (one reduction), guards, metrics.
        return self._control(record, rollout_batch, generated, update, before, reward_kl, sync, sync_check, correction,
                             episodes, timing, resident, moved_before)

    def _score_with_models(self, batch, old: ModelOutputs, clock) -> Scores:
        """Phase 3 after the actor: reference log-probs, values, the teacher's log-probs, as configured."""
        ref_logprobs = values = None
        if self.uses_ref:
            with clock("timing_s/ref"):
                ref = self.ref or self.actor
                ref_logprobs = ref.forward_only(batch, temperature=self.sampling.temperature,
                                                banned_token_ids=self.sampling.banned_token_ids,
                                                adapters=not self.ref_from_actor).logprobs
                if self.ref is not None:
                    self.ref.offload()
        if self.critic is not None:
            with clock("timing_s/values"):
                values = self.critic.forward_only(batch).values
        teacher_logprobs = None
        if self.distill is not None:
            with clock("timing_s/teacher"):
                teacher_logprobs = self.distill.score(batch, self.sampling.temperature, self.sampling.banned_token_ids)
        return Scores(old.logprobs, old.entropy, ref_logprobs, values, teacher_logprobs)

    def _rewards(self, generated: StepSamples, scored: Scores, mask: torch.Tensor):
        """Phase 4: (scores, per-token rewards, what GRPO / RLOO / ReMax read, the KL to the reference)."""
        alg = self.cfg.algorithm
        scores = torch.tensor(generated.scores if generated.scores is not None else self.score(generated.samples),
                              dtype=torch.float32)
        token_scores = scores_at_last_token(scores, mask)
        token_rewards, reward_kl = token_scores, 0.0
        if alg.use_kl_in_reward:
            token_rewards, _ = A.apply_kl_penalty(token_scores, scored.old_logprobs, scored.ref_logprobs,
                                                  mask, self.kl_ctrl.value, alg.kl_penalty)
        if self.uses_ref:
            kl = A.kl_penalty(scored.old_logprobs, scored.ref_logprobs, alg.kl_penalty) * mask
            reward_kl = self.global_batch.mean(A.masked_mean(kl, mask, dim=-1))
        advantage_scores = scores  # plus the distillation term in its reward mode
        if self.distill is not None:
            token_rewards, advantage_scores = self.distill.shape_rewards(token_rewards, scores, scored.old_logprobs,
                                                                         scored.teacher_logprobs, mask)
        return scores, token_rewards, advantage_scores, reward_kl

    def _update(self, record: StepRecord, reward_kl: float, clock):
        """Phase 6: the guards' verdict before the update, then critic and actor updates."""
        before = self.guards.before_update(reward_kl)
        update: dict[str, float] = {}
        if before.raise_kl_coef:
            self.kl_ctrl.raise_coef(2.0)
        if self.critic is not None:
            with clock("timing_s/update_critic"):
                update.update(update_critic(self.critic, record, self.cfg.critic, shuffle_seed=self._shuffle_seed(1),
                                            skip_grad_norm_above=self.cfg.guards.grad_norm_threshold or None))
        if not before.skip_actor_update and (self.critic is None or actor_updates_at(self.step, self.cfg.trainer.critic_warmup)):
            with clock("timing_s/update_actor"):
                update.update(update_actor(self.actor, record, self.cfg.actor, self.distill, shuffle_seed=self._shuffle_seed(0),
                                           temperature=self.sampling.temperature,
                                           banned_token_ids=self.sampling.banned_token_ids,
                                           skip_grad_norm_above=self.cfg.guards.grad_norm_threshold or None))
        return update, before

    def _control(self, record: StepRecord, rollout_batch: RolloutBatch, generated: StepSamples, update: dict, before,
                 reward_kl: float, sync, sync_check: StepResult, correction, episodes: dict, timing: dict, resident: dict,
                 moved_before: dict) -> StepResult:
        """Phase 7: KL controller, batch statistics (one reduction), guards, the step's metrics."""
        cfg, alg, batch, mask, scored = self.cfg, self.cfg.algorithm, record.batch, record.response_mask, record.scored
        if alg.use_kl_in_reward:
            self.kl_ctrl.update(reward_kl, n_steps=cfg.data.prompts_per_step * cfg.rollout.samples_per_prompt)
        batch_stats = self.global_batch.reduce(local_stats(
            scores=record.scores, token_rewards=record.token_rewards, mask=mask, advantages=record.advantages,
            returns=record.returns, entropy=record.scored.entropy, prompt_tokens=sum(batch.prompt_lens),
            max_new_tokens=self.sampling.max_new_tokens, old_values=record.scored.values,
            samples_per_prompt=self.sampling.n,
            overlong_from=self.sampling.max_new_tokens - cfg.reward.overlong_buffer.len if cfg.reward.overlong_buffer.len else None,
            rollout_prob_diff=token_prob_diff(rollout_batch.rollout_logprobs, record.scored.old_logprobs, mask)))
        after = self.guards.after_update(batch_stats["critic/score/mean"], all(math.isfinite(v) for v in update.values()))
        self._apply_guard_actions(after)
        explained_var = (self.global_batch.explained_variance(record.returns, record.scored.values, mask)
                         if self.critic is not None else None)
        events = sync_check.events + before.events + after.events
        metrics = step_metrics(
            batch_stats=batch_stats, update=update, reward_kl=reward_kl, kl_coef=self.kl_ctrl.value, actor_lr=self.actor.lr,
            sync_bytes=sync.bytes_received, sync_peak_bytes=sync.peak_extra_bytes, sync_full_bytes=sync.full_bytes_received,
            sync_changed_fraction=sync.changed_fraction, dropped_prompts=self.data.num_dropped,
            bytes_moved={kind: total - moved_before[kind] for kind, total in bytes_moved(self._engines()).items()},
            memory=process_memory_metrics(), timing=timing,
            resident=resident_metrics(resident, {"actor": self.actor, "critic": self.critic}, self.rollout.delta_copy_bytes(),
                                      self.dims.world_size),
            world_size=self.dims.world_size, explained_var=explained_var, guard_events=events)
        metrics.update(sync_check.metrics)
        metrics.update(correction.metrics)
        metrics["training/hybrid_sync_direct"] = float(self.rollout.weight_path == "direct")  # 1: shards into vLLM's parameters
        metrics["training/hybrid_sync_adapter"] = float(self.rollout.weight_path == "adapter")  # 1: only the LoRA adapters go
        metrics.update(generated.metrics)
        metrics.update(episodes)
        if self.distill is not None:
            metrics.update(self.distill.metrics(scored.old_logprobs, scored.teacher_logprobs, mask))
        return StepResult(metrics, events)

    def validate(self) -> dict[str, float]:
        """Greedy responses to the next prompts_per_step validation prompts, scored: val/score/mean."""
        self.rollout.hand_over(self.step)  # the weights after this step's update
        samples = self.rollout.generate(self.val_data.next_step(), self._greedy, self.step)
        self.rollout.release_memory()
        return {"val/score/mean": self.global_batch.mean(torch.tensor(self.score(samples), dtype=torch.float64))}

    @property
    def _greedy(self) -> SamplingParams:
        """One temperature-0 response per prompt (validation, the ReMax baseline)."""
        return replace(self.sampling, n=1, temperature=0.0)

    # --- guards, engines, seeds -------------------------------------------------------------------
    def _apply_guard_actions(self, verdict) -> None:
        # Roll back first: loading a checkpoint also restores the optimizers' learning rates, so
        # halving them before would be undone.
        if verdict.restore_checkpoint:
            latest = checkpoint.latest_checkpoint(self.cfg.trainer.run_dir)
            if latest is not None:
                checkpoint.restore(self, latest, weights_only=True)
        if verdict.halve_lr:
            for engine in self.checkpointed_engines().values():  # the trained engines
                engine.scale_lr(0.5)

    def _engines(self) -> list:
        teacher = self.distill.teacher if self.distill is not None else None
        return [engine for engine in (self.actor, self.critic, self.ref, teacher) if engine is not None]

    def _offload_all(self) -> None:
        """Training state out of the way of the rollout (as configured; bytes counted by the engines)."""
        for engine in self._engines():
            engine.offload()

    def _shuffle_seed(self, role: int) -> int:
        return (self.cfg.trainer.seed * 1_000_003 + self.step) * 2 + role


# --- small helpers ------------------------------------------------------------------------------


def _first_of_groups(samples: list[Sample], n: int) -> list[PromptRow]:
    """The prompts of prompt-major `samples`, n per prompt, in order."""
    return [samples[i].prompt for i in range(0, len(samples), n)]
