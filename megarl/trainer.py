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
StepRecord; the losses read LossInputs / ModelOutputs / Totals), built once by the phase that computes them.

The rollout side (colocated, separate, dynamic sampling around either) is chosen once, when the
trainer is built (megarl.rollout_side), so `ppo_step` reads as the phases of a step whatever the
variant. It is long because the Trainer builds the engines as well as running the loop and the
phases' helpers (scoring, updates, the weight-sync check).
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import psutil
import torch
import torch.distributed as dist

from megarl import algorithms as A
from megarl.checkpointing import checkpoint
from megarl.runtime import heartbeat, profiling
from megarl.step import rollout_corr
from megarl.async_rollout.trainer_side import remote_setup
from megarl.config import Config
from megarl.data.dataset import PromptDataset, PromptRow
from megarl.data.tokenizer import load_tokenizer
from megarl.step.distill import build_distillation
from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig
from megarl.step.global_batch import GlobalBatch, LocalStats
from megarl.step.guards import Guards
from megarl.hybrid.dispatch import DispatchGroups
from megarl.hybrid.engine import HybridEngine, release_cached_device_memory, streamed_shards
from megarl.hybrid.verify import WeightSyncMismatch, mismatch_message, sync_limits, sync_problem, sync_stats, token_prob_diff
from megarl.models.lora import LoraOptions
from megarl.hybrid.lora_sync import AdapterSync
from megarl.models.moe_routing import RouterOptions
from megarl.distributed.parallel import ParallelDims, all_reduce_host
from megarl.platform.process_groups import all_gather_object
from megarl.runtime.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionWatch
from megarl.runtime.profiling import StepProfiler
from megarl.rewards import build_reward_fn
from megarl.rewards.decode import check_token_ids, response_text
from megarl.rewards.model import RewardModel
from megarl.rewards.overlong import overlong_penalty
from megarl.rollout import build_rollout
from megarl.rollout.base import SamplingParams
from megarl.rollout.multi_turn import episode_metrics, with_environment
from megarl.rollout_side import StepSamples, WeightHandOver, build_rollout_side
from megarl.step.samples import RolloutBatch, Sample, id_records, merge_id_records, to_rollout_batch
from megarl.step.step_metrics import local_stats, step_metrics
from megarl.step.step_record import LossInputs, ModelOutputs, Scores, StepRecord, Totals, fields_of


def stop_token_ids(rollout, eos_token_id: int | None) -> tuple[int, ...]:
    """The tokens that end a response in every engine (each stops on exactly these, eos included
    only through this list): rollout.stop_token_ids, then eos unless rollout.ignore_eos."""
    eos = () if rollout.ignore_eos or eos_token_id is None else (eos_token_id,)
    return tuple(rollout.stop_token_ids) + eos


def actor_updates_at(step: int, critic_warmup: int) -> bool:
    """trainer.critic_warmup as verl applies it (`critic_warmup <= global_steps`, steps counted from
    1): the actor's first update is at step critic_warmup; the steps before it train only the critic,
    so the actor's first advantages come from a critic that has seen critic_warmup - 1 batches."""
    return critic_warmup <= step


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


class StepResult(NamedTuple):
    """What one `ppo_step` returns: its metrics and the guard events that fired, (name, fields)."""

    metrics: dict[str, float]
    events: list[tuple[str, dict]]


def _gspo_clip(actor_cfg) -> dict:
    """actor.clip_ratio_low / clip_ratio_high when set; otherwise gspo_policy_loss's defaults."""
    return {k: v for k, v in (("clip_ratio_low", actor_cfg.clip_ratio_low), ("clip_ratio_high", actor_cfg.clip_ratio_high))
            if v is not None}


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
        self.reward_fn = build_reward_fn(cfg.reward, reward_model)

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

        # --- rollout construction: the inference engine, the 3D-HybridEngine that feeds it the
        # actor's weights, the dispatch groups, the sampling parameters. The builder says which
        # weight layout the engine's load_weights accepts with its converter (vLLM on the dense
        # families: each rank's own rollout shard; otherwise full HF tensors) and owns each
        # backend's options. ------------------------------------------------------------------------
        r = cfg.rollout
        # Offloads as configured before the engine is built: vLLM and SGLang size their memory pools
        # from what is free at that moment (megarl/capacity/memory_check.py decides the offloads left null).
        self._offload_all()
        release_cached_device_memory()
        if separate is None:
            setup = build_rollout(r.engine, cfg.model.path, dims.rollout_groups(r.tp), seed=t.seed, device=str(self.actor.device),
                                  dtype=self.actor.params_dtype, memory_fraction=r.gpu_memory_utilization,
                                  max_model_len=cfg.data.max_prompt_tokens + r.max_new_tokens, train_tp=dims.tp,
                                  log=log if dims.rank == 0 else None, lora_rank=cfg.actor.lora.rank,
                                  lora_targets=cfg.actor.lora.target_modules, record_routes=cfg.actor.routing_replay)
        else:  # the engine runs on the rollout ranks: this rank's handle on its server
            setup = remote_setup(cfg, separate, dims.rank)
        self._say_moe_aux_loss(cfg)
        # actor.lora into vLLM: the base once, then only the adapters (megarl.hybrid.lora_sync)
        adapter_sync = AdapterSync(self.actor, self.actor.lora, cfg.model.path) if setup.weight_path == "adapter" else None
        hybrid = HybridEngine(self._actor_shards(), train=dims.layout, rollout=setup.weight_layout, bucket_bytes=r.bucket_bytes,
                              convert=setup.convert, separate=separate, mode=r.weight_sync.mode, full_every=r.weight_sync.full_every)
        # the ranks holding one DP batch split its prompts (CP ranks too: each generates its share, not all)
        batch_group, groups = dims.batch_group, setup.groups
        dispatch = DispatchGroups(mp_group=batch_group, mp_rank=dist.get_rank(batch_group), mp_size=dist.get_world_size(batch_group),
                                  rollout_group=groups.group, rollout_rank=groups.rank, rollout_size=groups.size)
        stop = stop_token_ids(r, self.tokenizer.eos_token_id)
        for key, ids in (("rollout.stop_token_ids", stop), ("rollout.banned_token_ids", r.banned_token_ids)):
            check_token_ids(key, ids, self.actor.spec.vocab_size)
        self.data.check_vocab(self.actor.spec.vocab_size)
        self.sampling = SamplingParams(n=r.samples_per_prompt, temperature=r.temperature, top_p=r.top_p,
                                       top_k=max(r.top_k, 0), max_new_tokens=r.max_new_tokens, stop_token_ids=stop, seed=t.seed,
                                       banned_token_ids=tuple(r.banned_token_ids))
        # the side of the step that generates, chosen here (megarl.rollout_side): colocated or
        # separate, inside dynamic sampling; under rollout.multi_turn its engine runs an episode per sample
        self.rollout = build_rollout_side(
            cfg, setup=setup, engine=with_environment(setup.engine, r, self.tokenizer, log=log if dims.rank == 0 else None),
            hand_over=WeightHandOver(hybrid, adapter_sync, self._offload_all, self._actor_shards), dispatch=dispatch,
            data=self.data, sampling=self.sampling, to_samples=self._to_samples, score=self._score,
            global_batch=self.global_batch, dims=dims, separate=separate)
        # --- end of rollout construction ----------------------------------------------------------
        self.val_data = None
        if t.val_every_steps and cfg.data.val_files:
            self.val_data = PromptDataset(
                cfg.data.val_files, prompts_per_step=cfg.data.prompts_per_step, dp_rank=dims.dp_rank, dp_size=dims.dp,
                seed=t.seed, shuffle=False, prompt_key=cfg.data.prompt_key, ground_truth_key=cfg.data.ground_truth_key,
                tokenizer=self.tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens,
                apply_chat_template=cfg.data.apply_chat_template, log=lambda _: None)
        self.guards = Guards(cfg.guards)
        self.step = 0  # PPO steps completed
        self._sync_checked = False  # the first weight-sync check of this process is fatal (_verify_sync)
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
        clock = _Clock(timing, after=lambda name: resident.update({name: self._resident_bytes()}))
        moved_before = self._bytes_moved()

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
            old = ModelOutputs.of(self.actor.forward_only(batch, entropy=True, temperature=self.sampling.temperature,
                                                          banned_token_ids=self.sampling.banned_token_ids))
        sync_check = (self._verify_sync(rollout_batch, old.logprobs, mask)
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
            advantages, returns = self._compute_advantages(rollout_batch, advantage_scores, token_rewards, scored.values, greedy)
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
                ref_logprobs = ModelOutputs.of(ref.forward_only(batch, temperature=self.sampling.temperature,
                                                                banned_token_ids=self.sampling.banned_token_ids,
                                                                adapters=not self.ref_from_actor)).logprobs
                if self.ref is not None:
                    self.ref.offload()
        if self.critic is not None:
            with clock("timing_s/values"):
                values = ModelOutputs.of(self.critic.forward_only(batch)).values
        teacher_logprobs = None
        if self.distill is not None:
            with clock("timing_s/teacher"):
                teacher_logprobs = self.distill.score(batch, self.sampling.temperature, self.sampling.banned_token_ids)
        return Scores(old.logprobs, old.entropy, ref_logprobs, values, teacher_logprobs)

    def _rewards(self, generated: StepSamples, scored: Scores, mask: torch.Tensor):
        """Phase 4: (scores, per-token rewards, what GRPO / RLOO / ReMax read, the KL to the reference)."""
        alg = self.cfg.algorithm
        scores = torch.tensor(generated.scores if generated.scores is not None else self._score(generated.samples),
                              dtype=torch.float32)
        token_scores = _scores_at_last_token(scores, mask)
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
                update.update(self._update_critic(record))
        if not before.skip_actor_update and (self.critic is None or actor_updates_at(self.step, self.cfg.trainer.critic_warmup)):
            with clock("timing_s/update_actor"):
                update.update(self._update_actor(record))
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
            bytes_moved={kind: total - moved_before[kind] for kind, total in self._bytes_moved().items()},
            memory=_memory_metrics(), resident=self._resident_metrics(resident), timing=timing,
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
        return {"val/score/mean": self.global_batch.mean(torch.tensor(self._score(samples), dtype=torch.float64))}

    # --- samples and scores: the training rollout, validation and the ReMax baseline ----------------
    def _to_samples(self, prompts: list[PromptRow], results, sampling: SamplingParams) -> list[Sample]:
        """The engine's results for `prompts` as Sample records (the reward's text decoded)."""
        by_index = {p.global_index: p for p in prompts}
        samples = []
        for result in results:
            response = list(result.response_token_ids)[: sampling.max_new_tokens]
            scaled = result.scaled_logprobs is not None
            samples.append(Sample(by_index[result.prompt_index], result.sample_index, response,
                                  list(result.scaled_logprobs if scaled else result.logprobs), scaled,
                                  response_text(self.tokenizer, response, sampling.stop_token_ids), result.routed_experts,
                                  tuple(result.versions[: len(response)]) if result.versions is not None else None,
                                  result.response_mask, result.env_reward, result.episode))
        return samples

    def _score(self, samples: list[Sample]) -> list[float]:
        """The reward function's score of each sample, plus DAPO's overlong penalty when
        reward.overlong_buffer.len is set (megarl.rewards.overlong)."""
        prompts = [s.prompt for s in samples]
        scores = self.reward_fn([p.prompt for p in prompts], [s.text for s in samples], [p.ground_truth for p in prompts],
                                [p.data_source for p in prompts], [p.extra for p in prompts])
        scores = [score + s.env_reward for score, s in zip(scores, samples)]  # multi-turn environments' rewards
        buffer = self.cfg.reward.overlong_buffer
        if buffer.len:
            scores = [score + overlong_penalty(len(s.response_ids), self.cfg.rollout.max_new_tokens, buffer.len,
                                               buffer.penalty_factor) for score, s in zip(scores, samples)]
        return scores

    @property
    def _greedy(self) -> SamplingParams:
        """One temperature-0 response per prompt (validation, the ReMax baseline)."""
        return replace(self.sampling, n=1, temperature=0.0)

    # --- phases ---------------------------------------------------------------------------------
    def _actor_shards(self):
        """The actor's weights for the rollout engine (a tied output layer once, as the embedding)."""
        return streamed_shards(self.actor.local_weight_shards(), self.actor.spec.tie_embeddings)

    def _compute_advantages(self, rollout_batch: RolloutBatch, scores: torch.Tensor, token_rewards: torch.Tensor,
                            values: torch.Tensor | None, greedy: list[Sample] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, R] advantages and returns of this rank's rows, computed on the all-gathered global
        batch (`values`: the critic's, GAE; `greedy`: ReMax's one greedy response per prompt,
        generated with the samples)."""
        alg, batch = self.cfg.algorithm, rollout_batch.batch
        mask = batch.response_mask
        g_mask, g_rewards, g_scores, g_groups, *g_values = self.global_batch.gather(
            mask, token_rewards, scores, rollout_batch.group_ids.float(), *([values] if values is not None else []))
        if alg.adv_estimator == "gae":
            advantages, returns = A.compute_gae(g_rewards, g_values[0], g_mask, alg.gamma, alg.lam)
            advantages = A.masked_whiten(advantages, g_mask)
        elif alg.adv_estimator == "grpo":
            advantages = A.compute_grpo_advantages(g_scores, g_groups.long(), g_mask, norm_by_std=alg.norm_adv_by_std_in_grpo)
            returns = advantages
        elif alg.adv_estimator == "rloo":
            advantages = A.compute_rloo_advantages(g_scores, g_groups.long(), g_mask)
            returns = advantages
        elif alg.adv_estimator == "reinforce_plus_plus":
            advantages, returns = A.compute_reinforce_pp_advantages(g_rewards, g_mask, alg.gamma)
        else:  # remax: baseline = score of a greedy response to the same prompt
            (baseline,) = self.global_batch.gather(self._greedy_baseline(greedy))
            advantages = A.compute_remax_advantages(g_scores, baseline, g_mask)
            returns = advantages
        first = self.global_batch.offset(len(batch))
        return advantages[first : first + len(batch)] * mask, returns[first : first + len(batch)] * mask

    def _greedy_baseline(self, greedy: list[Sample]) -> torch.Tensor:
        """[m] ReMax's baseline: the score of one greedy response per prompt, repeated for its samples."""
        return torch.tensor(self._score(greedy), dtype=torch.float32).repeat_interleave(self.sampling.n)

    def _update_critic(self, record: StepRecord) -> dict[str, float]:
        """Clipped value loss; critic.ppo_epochs x critic.ppo_mini_batches optimizer steps."""
        critic_cfg = self.cfg.critic
        response_len = record.batch.response_len

        def loss_fn(out, mb, totals):
            o, x, t = ModelOutputs.of(out), LossInputs.of(mb), Totals.of(totals)
            loss, metrics = A.value_loss(o.values, x.old_values, x.returns, x.response_mask, critic_cfg.vf_clip,
                                         agg=critic_cfg.loss_agg_mode, **_agg_totals(t, critic_cfg.loss_agg_mode, response_len))
            return loss, {**metrics, "critic/vf_loss": _local_loss_value(loss, t, x)}

        # for epoch in ppo_epochs: for mini_batch in ppo_mini_batches: forward/backward its micro-batches, optimizer step
        batch = record.critic_batch()
        stats = self.critic.train_step(batch, loss_fn, fields=fields_of(batch), epochs=critic_cfg.ppo_epochs,
                                       mini_batches=critic_cfg.ppo_mini_batches, shuffle_seed=self._shuffle_seed(1),
                                       skip_grad_norm_above=self.cfg.guards.grad_norm_threshold or None)
        self.critic.offload()
        return {**stats.metrics, "critic/grad_norm": _mean(stats.grad_norms), "critic/lr": self.critic.lr,
                "critic/skipped_steps": float(stats.skipped_steps)}

    def _update_actor(self, record: StepRecord) -> dict[str, float]:
        """Clipped surrogate (or GSPO), dual clip, entropy bonus, KL loss; actor.ppo_epochs x
        actor.ppo_mini_batches optimizer steps."""
        actor_cfg = self.cfg.actor
        agg_mode = actor_cfg.loss_agg_mode
        clip_low = actor_cfg.clip_ratio_low if actor_cfg.clip_ratio_low is not None else actor_cfg.clip_ratio
        clip_high = actor_cfg.clip_ratio_high if actor_cfg.clip_ratio_high is not None else actor_cfg.clip_ratio
        response_len = record.batch.response_len

        def loss_fn(out, mb, totals):
            o, x, t = ModelOutputs.of(out), LossInputs.of(mb), Totals.of(totals)
            mask = x.response_mask
            agg = _agg_totals(t, agg_mode, response_len)
            if actor_cfg.policy_loss == "gspo":
                # GSPO clips a sequence-level ratio: its own bounds (clip_ratio_low/high, GSPO's 3e-4 / 4e-4
                # when unset); PPO's clip_ratio and dual clip do not apply (validation refuses them)
                pg_loss, metrics = A.gspo_policy_loss(o.logprobs, x.old_logprobs, x.advantages, mask, agg=agg_mode,
                                                      rollout_is_weights=x.rollout_is_weights, **_gspo_clip(actor_cfg), **agg)
            else:
                pg_loss, metrics = A.policy_loss(o.logprobs, x.old_logprobs, x.advantages, mask,
                                                 clip_ratio_low=clip_low, clip_ratio_high=clip_high,
                                                 clip_ratio_c=actor_cfg.clip_ratio_c, agg=agg_mode,
                                                 rollout_is_weights=x.rollout_is_weights, **agg)
            loss = pg_loss
            metrics = {**metrics, "actor/pg_loss": _local_loss_value(pg_loss, t, x)}
            if actor_cfg.entropy_coeff > 0:
                entropy = A.agg_loss(o.entropy, mask, agg_mode, **agg)
                loss = loss - actor_cfg.entropy_coeff * entropy
            if actor_cfg.use_kl_loss:
                kl = A.agg_loss(A.kl_penalty(o.logprobs, x.ref_logprobs, actor_cfg.kl_loss_type), mask, agg_mode, **agg)
                loss = loss + actor_cfg.kl_loss_coef * kl
                metrics["actor/kl_loss"] = _local_loss_value(kl, t, x)
            if distill_loss:  # algorithm.distill.mode=loss: the reverse KL to the teacher (megarl.step.distill)
                rkl = self.distill.loss(o.logprobs, x.teacher_logprobs, mask, agg_mode, **agg)
                loss = loss + self.distill.coef * rkl
                metrics["actor/distill_loss"] = _local_loss_value(rkl, t, x)
            return loss, metrics

        # for epoch in ppo_epochs: for mini_batch in ppo_mini_batches: forward/backward its micro-batches, optimizer step
        distill_loss = self.distill is not None and self.distill.in_loss
        batch = record.actor_batch(kl_loss=actor_cfg.use_kl_loss, distill_loss=distill_loss)
        stats = self.actor.train_step(batch, loss_fn, fields=fields_of(batch), epochs=actor_cfg.ppo_epochs,
                                      mini_batches=actor_cfg.ppo_mini_batches, shuffle_seed=self._shuffle_seed(0),
                                      entropy=actor_cfg.entropy_coeff > 0,
                                      temperature=self.sampling.temperature, banned_token_ids=self.sampling.banned_token_ids,
                                      skip_grad_norm_above=self.cfg.guards.grad_norm_threshold or None)
        self.actor.offload()
        return {**stats.metrics, "actor/grad_norm": _mean(stats.grad_norms), "actor/skipped_steps": float(stats.skipped_steps),
                **({"actor/moe_aux_loss": stats.moe_aux_loss} if stats.moe_aux_loss is not None else {})}

    # --- checks, guards, offload -----------------------------------------------------------------
    def _verify_sync(self, rollout_batch: RolloutBatch, actor_logprobs: torch.Tensor, mask: torch.Tensor) -> StepResult:
        """rollout.verify_weights: the engine's log-probs of its own samples must equal the actor's
        (megarl.hybrid.verify). The first sync of this process raises WeightSyncMismatch over the
        limit (layout and name-mapping bugs); later ones fire guard/weight_sync. Returns the
        statistics as metrics and the events; a collective over the DP group."""
        truncated = self.cfg.rollout.top_k > 0 or self.cfg.rollout.top_p < 1.0
        if not self.cfg.rollout.verify_weights or (truncated and not rollout_batch.logprobs_are_scaled):
            return StepResult({}, [])  # processed log-probs of a truncated distribution are not what the actor computes
        stats = self._global_sync_stats(rollout_batch.rollout_logprobs, actor_logprobs, mask)
        first, self._sync_checked = not self._sync_checked, True
        metrics = {f"training/sync_logprob_diff_{k}": stats[k] for k in ("mean", "p99", "max")}
        # per dtype: a statistic that bf16 kernel noise passes and a corrupted layer does not; judged
        # on the worst rank's mean (a bad shard on one rank must not hide in the global mean)
        limit = self.cfg.rollout.verify_weights_mean_atol
        problem = sync_problem({**stats, "mean": stats["worst_rank_mean"]}, self.cfg.model.dtype, limit)
        if problem is None:
            return StepResult(metrics, [])
        where = f"rollout.engine={self.cfg.rollout.engine} ({self.actor.spec.family} model)"
        if first:  # every rank holds the same stats, so every rank raises here
            raise WeightSyncMismatch(mismatch_message(where, problem + " (first sync of this run)"))
        if self.dims.rank == 0:
            self.log(f"megarl: step {self.step}: guard/weight_sync: {where}: {problem}; training goes on "
                     "(only the first sync is fatal; rollout.verify_weights_mean_atol sets the limit)")
        limits = sync_limits(self.cfg.model.dtype, limit)
        return StepResult(metrics, [("guard/weight_sync", {**metrics, "mean_limit": limits.mean_atol})])

    def _global_sync_stats(self, engine_logprobs: torch.Tensor, actor_logprobs: torch.Tensor,
                           mask: torch.Tensor) -> dict[str, float]:
        """sync_stats over the DP group, identical on every rank: mean over all tokens, the worst
        rank's mean, the largest rank's p99, max, tokens (one all-gather)."""
        local = sync_stats(engine_logprobs, actor_logprobs, mask)
        stats = LocalStats()
        stats.masked_mean("mean", torch.tensor(local["mean"]), torch.tensor(local["tokens"]))  # token-weighted
        for name in ("mean", "p99", "max"):
            stats.max(f"worst_rank_{name}", torch.tensor(local[name]))
        stats.sum("tokens", torch.tensor(local["tokens"]))
        out = self.global_batch.reduce(stats)
        return {"mean": out["mean"], "worst_rank_mean": out["worst_rank_mean"], "p99": out["worst_rank_p99"],
                "max": out["worst_rank_max"], "tokens": out["tokens"]}

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

    def _bytes_moved(self) -> dict[str, int]:
        """Bytes offloaded and onloaded so far by this rank's engines."""
        return {kind: sum(e.bytes_moved[kind] for e in self._engines()) for kind in ("offload", "onload")}

    def _resident_bytes(self) -> int:
        return sum(sum(e.resident_bytes().values()) for e in self._engines())

    def _resident_metrics(self, resident: dict[str, int]) -> dict[str, float]:
        """memory/resident_gb/<phase>: the engines' parameters, gradients and optimizer state in
        memory at the end of each phase; memory/<role>/{param,trainable_param,grad,optimizer_state}_bytes:
        each trained engine's state by size (under LoRA the last three follow the adapters);
        memory/weight_sync_copy_bytes: what rollout.weight_sync.mode=delta keeps between syncs (0 under
        full). All the maximum over ranks, in one collective per step."""
        names = {f"memory/resident_gb/{p.removeprefix('timing_s/')}": resident[p] / 2**30 for p in resident}
        names["memory/weight_sync_copy_bytes"] = float(self.rollout.delta_copy_bytes())
        for role, engine in (("actor", self.actor), ("critic", self.critic)):
            if engine is not None:
                sizes = engine.state_bytes()
                names.update({f"memory/{role}/{_STATE_NAMES[part]}_bytes": float(sizes[part]) for part in _STATE_NAMES})
        values = torch.tensor(list(names.values()), dtype=torch.float64)
        if self.dims.world_size > 1:
            values = all_reduce_host(values, None, op=dist.ReduceOp.MAX)
        return {name: float(v) for name, v in zip(names, values)}

    # --- seeds -----------------------------------------------------------------------------------
    def _shuffle_seed(self, role: int) -> int:
        return (self.cfg.trainer.seed * 1_000_003 + self.step) * 2 + role


# --- small helpers ------------------------------------------------------------------------------


def _first_of_groups(samples: list[Sample], n: int) -> list[PromptRow]:
    """The prompts of prompt-major `samples`, n per prompt, in order."""
    return [samples[i].prompt for i in range(0, len(samples), n)]


def _scores_at_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[m] sequence scores -> [m, R] token rewards with the score on the last policy token (a
    multi-turn response's mask has holes where the environment spoke)."""
    token = torch.zeros_like(mask)
    positions = torch.arange(mask.shape[-1]).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(-1).values.clamp_min(0)
    token[torch.arange(len(scores)), last] = scores * (mask.sum(-1) > 0)
    return token


def _agg_totals(totals: Totals, mode: str, response_len: int) -> dict:
    return {"global_tokens": totals.tokens, "global_seqs": totals.seqs,
            "loss_scale_factor": float(response_len) if mode == "seq-mean-token-sum-norm" else None}


def _local_loss_value(loss: torch.Tensor, totals: Totals, inputs: LossInputs) -> torch.Tensor:
    """A micro-batch's loss contribution expressed per token of the micro-batch, so that the
    engine's token-weighted average over micro-batches gives back the mini-batch loss. A float64
    tensor (no host sync; the engine reads the step's metrics once): the same arithmetic as in floats.
    The token count is the micro-batch's, counted on the host when it was built."""
    return loss.detach().double() * float(totals.tokens) / max(inputs.response_tokens, 1.0)


# MegatronEngine.state_bytes parts -> metric names
_STATE_NAMES = {"params": "param", "trainable_params": "trainable_param", "grads": "grad", "optimizer": "optimizer_state"}


def _memory_metrics() -> dict[str, float]:
    out = {"perf/cpu_rss_gb": psutil.Process().memory_info().rss / 2**30}
    if torch.cuda.is_available():
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


class _Clock:
    """Times named phases into `timing`; `after(name)` runs at the end of each (memory sampling)."""

    def __init__(self, timing: dict, after=None):
        self.timing, self.after = timing, after

    def __call__(self, name: str):
        return _Timer(self, name)


class _Timer:
    def __init__(self, clock: _Clock, name: str):
        self.clock, self.name = clock, name

    def __enter__(self):
        heartbeat.enter(self.name)  # the phase a stall report names (megarl/runtime/heartbeat.py)
        self.range = profiling.phase(self.name.replace("timing_s/", "ppo_step/"))
        self.range.__enter__()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.range.__exit__(*exc)
        timing = self.clock.timing
        timing[self.name] = timing.get(self.name, 0.0) + time.perf_counter() - self.start
        if self.clock.after is not None and exc[0] is None:
            self.clock.after(self.name)
