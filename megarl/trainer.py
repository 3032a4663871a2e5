"""The PPO loop: one `ppo_step` reads top to bottom like the algorithm box of a paper.

    for step in 1..total_steps:
        sync     actor weights -> rollout engine (3D-HybridEngine, bucketed)
        rollout  n samples per prompt, seeded by (seed, step, prompt, sample)
        score    old log-probs, reference log-probs, values, rewards, KL in the reward
        advantage  GAE / GRPO / RLOO / REINFORCE++ / ReMax over the *global* batch
        update   critic (clipped value loss), then actor (clipped surrogate, dual-clip, KL, entropy)
        control  KL controller, guards, metrics, checkpoint

All ranks run this same program (SPMD). Each data-parallel rank owns prompts_per_step / dp prompts
and their samples; quantities defined over the whole batch (advantage whitening, group baselines,
the KL controller's input) are computed on the all-gathered batch, so every layout computes the
same numbers.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from megarl import algorithms as A
from megarl import checkpoint
from megarl.config import Config
from megarl.engine.batch import SequenceBatch
from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig
from megarl.global_batch import GlobalBatch
from megarl.guards import Guards
from megarl.parallel import ParallelDims, all_reduce_host


def engine_config(cfg: Config, role: str, total_steps: int) -> EngineConfig:
    """The Megatron engine settings of one role (actor / critic / ref) from the run config."""
    if role == "ref":
        return EngineConfig(dtype=cfg.model.dtype, param_offload=cfg.ref.param_offload, sequence_packing=cfg.model.sequence_packing)
    r = getattr(cfg, role)
    o = r.optim
    updates_per_step = r.ppo_epochs * r.ppo_mini_batches
    # Schedules count trainer steps in the config (as verl does); Megatron's scheduler counts
    # optimizer steps, so convert.
    optim = OptimConfig(lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.eps, max_grad_norm=o.max_grad_norm,
                        warmup_steps=o.warmup_steps * updates_per_step, schedule=o.schedule, min_lr=o.min_lr,
                        total_steps=total_steps * updates_per_step)
    return EngineConfig(dtype=cfg.model.dtype, optim=optim, max_tokens_per_microbatch=r.max_tokens_per_microbatch,
                        param_offload=r.param_offload, grad_offload=r.grad_offload, optimizer_offload=r.optimizer_offload,
                        recompute=r.recompute, sequence_packing=cfg.model.sequence_packing)


class StepResult(NamedTuple):
    """What one `ppo_step` returns: its metrics and the guard events that fired, (name, fields)."""

    metrics: dict[str, float]
    events: list[tuple[str, dict]]


@dataclass
class Rollout:
    """This DP rank's samples of one step."""

    batch: SequenceBatch
    rollout_logprobs: torch.Tensor  # [m, R], from the engine (temperature-scaled where it reports them)
    logprobs_are_scaled: bool  # False: the engine reported top-k/top-p-processed log-probs only
    prompts: list[str]
    responses: list[str]
    ground_truths: list[str]
    data_sources: list[str]
    extras: list[dict]
    group_ids: torch.Tensor  # [m] global prompt index


class Trainer:
    def __init__(self, cfg: Config, dims: ParallelDims, log=print):
        from transformers import AutoTokenizer

        from megarl.data.dataset import PromptDataset
        from megarl.hybrid.dispatch import DispatchGroups, consecutive_rollout_group
        from megarl.hybrid.engine import HybridEngine
        from megarl.hybrid.layout import RolloutLayout, TrainLayout
        from megarl.models.convert import to_hf, weight_mappings
        from megarl.rewards import build_reward_fn
        from megarl.rollout import build_rollout_engine
        from megarl.rollout.base import SamplingParams

        self.cfg, self.dims, self.log = cfg, dims, log
        self.global_batch = GlobalBatch(dims)
        t = cfg.trainer
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.data = PromptDataset(
            cfg.data.train_files, prompts_per_step=cfg.data.prompts_per_step, dp_rank=dims.dp_rank, dp_size=dims.dp,
            seed=t.seed, shuffle=cfg.data.shuffle, prompt_key=cfg.data.prompt_key,
            ground_truth_key=cfg.data.ground_truth_key, tokenizer=self.tokenizer,
            max_prompt_tokens=cfg.data.max_prompt_tokens, apply_chat_template=cfg.data.apply_chat_template,
            log=log if dims.rank == 0 else (lambda _: None))
        reward_model = None
        if cfg.reward.kind == "model":
            from megarl.rewards.model import RewardModel

            reward_model = RewardModel(cfg.reward.model_path, dims, dtype=cfg.model.dtype,
                                       sequence_packing=cfg.model.sequence_packing)
        self.reward_fn = build_reward_fn(cfg.reward, reward_model)

        alg = cfg.algorithm
        self.uses_critic = alg.adv_estimator == "gae"
        self.uses_ref = alg.use_kl_in_reward or cfg.actor.use_kl_loss
        self.actor = MegatronEngine(cfg.model.path, dims, engine_config(cfg, "actor", t.total_steps), seed=t.seed)
        self.critic = (MegatronEngine(cfg.critic.model_path or cfg.model.path, dims, engine_config(cfg, "critic", t.total_steps), critic=True, seed=t.seed)
                       if self.uses_critic else None)
        self.ref = (MegatronEngine(cfg.model.path, dims, engine_config(cfg, "ref", t.total_steps), trainable=False)
                    if self.uses_ref else None)
        k = alg.kl_ctrl
        # The KL coefficient's one writer: the controller (its update, and raise_coef for the KL guard).
        self.kl_ctrl = (A.AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon, min_kl_coef=k.min_coef, max_kl_coef=k.max_coef)
                        if k.type == "adaptive" else A.FixedKLController(k.kl_coef, max_kl_coef=k.max_coef))

        # Rollout engine + the 3D-HybridEngine that feeds it the actor's weights.
        r = cfg.rollout
        group, group_ranks, group_rank = consecutive_rollout_group(r.tp)
        engine_options = {
            "hf": {},
            "vllm": {"gpu_memory_utilization": r.gpu_memory_utilization, "max_model_len": cfg.data.max_prompt_tokens + r.max_new_tokens},
            "sglang": {"mem_fraction_static": r.gpu_memory_utilization},
        }[r.engine]
        self.rollout = build_rollout_engine(r.engine, cfg.model.path, tp=r.tp, seed=t.seed,
                                            device=str(self.actor.device), dtype=self.actor.module.config.params_dtype,
                                            group=group, group_ranks=group_ranks, **engine_options)
        mappings = {m.name: m for m in weight_mappings(self.actor.spec, dims.tp)}
        convert = lambda name, full: to_hf(mappings[name], full)  # noqa: E731
        self.hybrid = HybridEngine(self._actor_shards(), train=TrainLayout(tp=dims.tp, pp=dims.pp, dp=dims.dp, ep=dims.ep),
                                   rollout=RolloutLayout(tp=r.tp), bucket_bytes=r.bucket_bytes, convert=convert)
        self.dispatch = DispatchGroups(mp_group=dims.mp_group, mp_rank=dist.get_rank(dims.mp_group), mp_size=dims.tp * dims.pp,
                                       rollout_group=group, rollout_rank=group_rank, rollout_size=r.tp)
        stop = tuple(r.stop_token_ids) + ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        self.sampling = SamplingParams(n=r.samples_per_prompt, temperature=r.temperature, top_p=r.top_p,
                                       top_k=max(r.top_k, 0), max_new_tokens=r.max_new_tokens, stop_token_ids=stop, seed=t.seed)
        self.val_data = None
        if t.val_every_steps and cfg.data.val_files:
            self.val_data = PromptDataset(
                cfg.data.val_files, prompts_per_step=cfg.data.prompts_per_step, dp_rank=dims.dp_rank, dp_size=dims.dp,
                seed=t.seed, shuffle=False, prompt_key=cfg.data.prompt_key, ground_truth_key=cfg.data.ground_truth_key,
                tokenizer=self.tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens,
                apply_chat_template=cfg.data.apply_chat_template, log=lambda _: None)
        self.guards = Guards(cfg.guards)
        self.step = 0  # PPO steps completed

    # --- the loop and its state ---------------------------------------------------------------------
    def train(self, tracker) -> None:
        """Steps step+1 .. trainer.total_steps: PPO step, validation, metrics and guard events to
        the tracker, checkpoints. Collective: every rank calls it."""
        t = self.cfg.trainer
        while self.step < t.total_steps:
            self.step += 1
            last = self.step == t.total_steps
            metrics, events = self.ppo_step()
            if self.val_data is not None and (self.step % t.val_every_steps == 0 or last):
                metrics.update(self.validate())
            tracker.log(metrics, step=self.step)
            for name, fields in events:
                tracker.event(name, step=self.step, **fields)
            if t.save_every_steps and (self.step % t.save_every_steps == 0 or last):
                checkpoint.save(self, t.run_dir, self.step, keep_last=t.keep_last_checkpoints)

    def resume(self) -> Path | None:
        """Load the checkpoint trainer.resume names (auto: the newest complete one, if any); returns it."""
        start = checkpoint.resume_point(self.cfg.trainer.run_dir, self.cfg.trainer.resume)
        if start is not None:
            checkpoint.restore(self, start)
        return start

    def checkpointed_engines(self) -> dict[str, MegatronEngine]:
        """The engines a checkpoint holds, by directory name (the reference is frozen: not saved)."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def state_dict(self) -> dict:
        """The run state beside the engines' weights and optimizers (trainer.pt of a checkpoint)."""
        return {"step": self.step, "kl_ctrl": self.kl_ctrl.state_dict(), "data": self.data.state_dict(),
                "guards": self.guards.state.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        # Checkpoints written before this version also hold "lr_scale", which nothing read: ignored.
        self.step = state["step"]
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.data.load_state_dict(state["data"])
        self.guards.state.load_state_dict(state["guards"])

    # ------------------------------------------------------------------------------------------
    def ppo_step(self) -> StepResult:
        """One PPO iteration (step number self.step); returns the step's metrics (identical on every
        rank) and the guard events that fired."""
        cfg, alg, timing, resident = self.cfg, self.cfg.algorithm, {}, {}
        clock = _Clock(timing, after=lambda name: resident.update({name: self._resident_bytes()}))
        moved_before = self._bytes_moved()

        with clock("timing_s/sync"):
            sync = self.hybrid.sync(self.rollout, self._actor_shards())
            self._offload_all()
        with clock("timing_s/gen"):
            ro = self._generate()
            self.rollout.release_memory()
        b, mask = ro.batch, ro.batch.response_mask

        with clock("timing_s/old_log_prob"):
            out = self.actor.forward_only(b, want=("logprobs", "entropy"), temperature=self.sampling.temperature)
            b.tensors["old_logprobs"], entropy = out["logprobs"], out["entropy"]
        self._verify_sync(ro, b.tensors["old_logprobs"], mask)
        if self.ref is not None:
            with clock("timing_s/ref"):
                b.tensors["ref_logprobs"] = self.ref.forward_only(b, temperature=self.sampling.temperature)["logprobs"]
                self.ref.offload()
        if self.critic is not None:
            with clock("timing_s/values"):
                b.tensors["old_values"] = self.critic.forward_only(b)["values"]

        with clock("timing_s/reward"):
            scores = torch.tensor(self.reward_fn(ro.prompts, ro.responses, ro.ground_truths, ro.data_sources, ro.extras), dtype=torch.float32)
            token_scores = _scores_at_last_token(scores, mask)
            token_rewards, reward_kl = token_scores, 0.0
            if alg.use_kl_in_reward:
                token_rewards, _ = A.apply_kl_penalty(token_scores, b.tensors["old_logprobs"], b.tensors["ref_logprobs"],
                                                      mask, self.kl_ctrl.value, alg.kl_penalty)
            if self.ref is not None:
                kl = A.kl_penalty(b.tensors["old_logprobs"], b.tensors["ref_logprobs"], alg.kl_penalty) * mask
                reward_kl = self.global_batch.mean(A.masked_mean(kl, mask, dim=-1))

        with clock("timing_s/adv"):
            self._compute_advantages(ro, scores, token_rewards)

        verdict = self.guards.before_update(reward_kl)
        metrics: dict[str, float] = {}
        if verdict.raise_kl_coef:
            self.kl_ctrl.raise_coef(2.0)
        if self.critic is not None:
            with clock("timing_s/update_critic"):
                metrics.update(self._update_critic(b))
        if not verdict.skip_actor_update:
            with clock("timing_s/update_actor"):
                metrics.update(self._update_actor(b))
        if alg.use_kl_in_reward:
            self.kl_ctrl.update(reward_kl, n_steps=cfg.data.prompts_per_step * cfg.rollout.samples_per_prompt)

        score_mean = self.global_batch.mean(scores)
        after = self.guards.after_update(score_mean, all(math.isfinite(v) for v in metrics.values()))
        self._apply_guard_actions(after)
        resp_len = mask.sum(-1)
        tokens = self.global_batch.sum(mask.sum() + torch.tensor(float(sum(b.prompt_lens))))
        metrics.update({
            "critic/score/mean": score_mean,
            "critic/score/max": self.global_batch.max(scores),
            "critic/score/min": self.global_batch.min(scores),
            "critic/rewards/mean": self.global_batch.mean((token_rewards * mask).sum(-1)),
            "critic/advantages/mean": self.global_batch.masked_mean(b.tensors["advantages"], mask),
            "critic/returns/mean": self.global_batch.masked_mean(b.tensors["returns"], mask),
            "actor/entropy": self.global_batch.masked_mean(entropy, mask),
            "actor/reward_kl_penalty": reward_kl,
            "actor/reward_kl_penalty_coeff": float(self.kl_ctrl.value),
            "actor/lr": self.actor.lr,
            "response_length/mean": self.global_batch.mean(resp_len.float()),
            "response_length/clip_ratio": self.global_batch.mean((resp_len >= self.sampling.max_new_tokens).float()),
            "training/hybrid_sync_bytes": float(sync.bytes_received),
            "training/hybrid_sync_peak_bytes": float(sync.peak_extra_bytes),
            "training/data_dropped_prompts": float(self.data.num_dropped),
            **{f"perf/{kind}_bytes": float(total - moved_before[kind]) for kind, total in self._bytes_moved().items()},
            **_memory_metrics(),
            **self._resident_metrics(resident),
            **self._rollout_gap(ro, b.tensors["old_logprobs"], mask),
            **timing,
        })
        if self.critic is not None:
            metrics["critic/values/mean"] = self.global_batch.masked_mean(b.tensors["old_values"], mask)
            metrics["critic/vf_explained_var"] = self.global_batch.explained_variance(b.tensors["returns"], b.tensors["old_values"], mask)
        step_time = sum(v for k, v in timing.items())
        metrics["timing_s/step"] = step_time
        metrics["perf/throughput"] = tokens / max(step_time, 1e-9) / self.dims.world_size
        events = verdict.events + after.events
        for name, _ in events:  # each guard firing is a metric as well as an event
            metrics[name] = metrics.get(name, 0.0) + 1.0
        return StepResult(metrics, events)

    def validate(self) -> dict[str, float]:
        """Greedy responses to the next prompts_per_step validation prompts, scored: val/score/mean."""
        from dataclasses import replace

        from megarl.hybrid.dispatch import generate_for_training
        from megarl.rollout.base import RolloutRequest

        self.hybrid.sync(self.rollout, self._actor_shards())  # the weights after this step's update
        self._offload_all()
        rows = self.val_data.next_step()
        requests = [RolloutRequest(tuple(r.prompt_ids), prompt_index=r.global_index, step=self.step) for r in rows]
        results = generate_for_training(self.rollout, requests, replace(self.sampling, n=1, temperature=0.0), self.dispatch)
        self.rollout.release_memory()
        texts = [self.tokenizer.decode(r.response_token_ids, skip_special_tokens=True) for r in results]
        scores = self.reward_fn([r.prompt for r in rows], texts, [r.ground_truth for r in rows],
                                [r.data_source for r in rows], [r.extra for r in rows])
        return {"val/score/mean": self.global_batch.mean(torch.tensor(scores, dtype=torch.float64))}

    # --- phases ---------------------------------------------------------------------------------
    def _actor_shards(self):
        """The actor's weights for the rollout engine. With tied embeddings under pp > 1 the last
        stage holds a copy of the embedding as its output layer: the engine needs it once."""
        shards = self.actor.local_weight_shards()
        if self.actor.spec.tie_embeddings:
            shards.pop("output_layer.weight", None)
        return shards

    def _generate(self) -> Rollout:
        from megarl.hybrid.dispatch import generate_for_training
        from megarl.rollout.base import RolloutRequest

        rows = self.data.next_step()
        requests = [RolloutRequest(tuple(r.prompt_ids), prompt_index=r.global_index, step=self.step) for r in rows]
        results = generate_for_training(self.rollout, requests, self.sampling, self.dispatch)
        by_index = {r.global_index: r for r in rows}
        n, width = self.sampling.n, self.sampling.max_new_tokens
        input_ids, prompt_lens, global_index, texts = [], [], [], []
        mask = torch.zeros(len(results), width)
        rollout_lp = torch.zeros(len(results), width)
        for i, res in enumerate(results):
            row = by_index[res.prompt_index]
            resp = list(res.response_token_ids)[:width]
            input_ids.append(list(row.prompt_ids) + resp)
            prompt_lens.append(len(row.prompt_ids))
            global_index.append(res.prompt_index * n + res.sample_index)
            mask[i, : len(resp)] = 1.0
            lp = res.scaled_logprobs if res.scaled_logprobs is not None else res.logprobs
            rollout_lp[i, : len(resp)] = torch.tensor(lp[: len(resp)], dtype=torch.float32)
            texts.append(self.tokenizer.decode(resp, skip_special_tokens=True))
        sample_rows = [by_index[res.prompt_index] for res in results]
        batch = SequenceBatch(input_ids, prompt_lens, global_index, width, {"response_mask": mask})
        scaled = all(res.scaled_logprobs is not None for res in results)
        return Rollout(batch, rollout_lp, scaled, [r.prompt for r in sample_rows], texts, [r.ground_truth for r in sample_rows],
                       [r.data_source for r in sample_rows], [r.extra for r in sample_rows],
                       torch.tensor([res.prompt_index for res in results]))

    def _compute_advantages(self, ro: Rollout, scores: torch.Tensor, token_rewards: torch.Tensor) -> None:
        """Advantages and returns on the all-gathered global batch, then this rank's rows."""
        alg, b = self.cfg.algorithm, ro.batch
        mask = b.response_mask
        g = self.global_batch.gather({"mask": mask, "rewards": token_rewards, "scores": scores, "groups": ro.group_ids.float(),
                             **({"values": b.tensors["old_values"]} if self.critic is not None else {})})
        if alg.adv_estimator == "gae":
            adv, returns = A.compute_gae(g["rewards"], g["values"], g["mask"], alg.gamma, alg.lam)
            adv = A.masked_whiten(adv, g["mask"])
        elif alg.adv_estimator == "grpo":
            adv = A.compute_grpo_advantages(g["scores"], g["groups"].long(), g["mask"], norm_by_std=alg.norm_adv_by_std_in_grpo)
            returns = adv
        elif alg.adv_estimator == "rloo":
            adv = A.compute_rloo_advantages(g["scores"], g["groups"].long(), g["mask"])
            returns = adv
        elif alg.adv_estimator == "reinforce_plus_plus":
            adv, returns = A.compute_reinforce_pp_advantages(g["rewards"], g["mask"], alg.gamma)
        else:  # remax: baseline = score of a greedy response to the same prompt
            baseline = self.global_batch.gather({"b": self._greedy_baseline(ro)})["b"]
            adv = A.compute_remax_advantages(g["scores"], baseline, g["mask"])
            returns = adv
        lo = self.global_batch.offset(len(b))
        b.tensors["advantages"] = adv[lo : lo + len(b)] * mask
        b.tensors["returns"] = returns[lo : lo + len(b)] * mask

    def _greedy_baseline(self, ro: Rollout) -> torch.Tensor:
        from dataclasses import replace

        from megarl.hybrid.dispatch import generate_for_training
        from megarl.rollout.base import RolloutRequest

        n = self.sampling.n
        firsts = list(range(0, len(ro.batch), n))
        requests = [RolloutRequest(tuple(ro.batch.input_ids[i][: ro.batch.prompt_lens[i]]), prompt_index=int(ro.group_ids[i]), step=self.step) for i in firsts]
        self.rollout.resume_memory()
        greedy = generate_for_training(self.rollout, requests, replace(self.sampling, n=1, temperature=0.0), self.dispatch)
        self.rollout.release_memory()
        texts = [self.tokenizer.decode(r.response_token_ids, skip_special_tokens=True) for r in greedy]
        base = self.reward_fn([ro.prompts[i] for i in firsts], texts, [ro.ground_truths[i] for i in firsts],
                              [ro.data_sources[i] for i in firsts], [ro.extras[i] for i in firsts])
        return torch.tensor(base, dtype=torch.float32).repeat_interleave(n)

    def _update_critic(self, b: SequenceBatch) -> dict[str, float]:
        c = self.cfg.critic

        def loss_fn(out, mb, totals):
            return A.value_loss(out["values"], mb["old_values"], mb["returns"], mb["response_mask"], c.vf_clip,
                                agg=c.loss_agg_mode, **_agg_totals(totals, c.loss_agg_mode, b.response_len))

        def with_loss(out, mb, totals):
            loss, m = loss_fn(out, mb, totals)
            return loss, {**m, "critic/vf_loss": _local_loss_value(loss, totals, mb)}

        stats = self.critic.train_step(b, with_loss, fields=("old_values", "returns"), epochs=c.ppo_epochs,
                                       mini_batches=c.ppo_mini_batches, shuffle_seed=self._shuffle_seed(1),
                                       skip_grad_norm_above=self.cfg.guards.grad_norm_threshold or None)
        self.critic.offload()
        return {**stats.metrics, "critic/grad_norm": _mean(stats.grad_norms), "critic/lr": self.critic.lr,
                "critic/skipped_steps": float(stats.skipped_steps)}

    def _update_actor(self, b: SequenceBatch) -> dict[str, float]:
        a = self.cfg.actor
        low = a.clip_ratio_low if a.clip_ratio_low is not None else a.clip_ratio
        high = a.clip_ratio_high if a.clip_ratio_high is not None else a.clip_ratio
        fields = ("old_logprobs", "advantages") + (("ref_logprobs",) if a.use_kl_loss else ())
        want = ("logprobs", "entropy") if a.entropy_coeff > 0 else ("logprobs",)

        def loss_fn(out, mb, totals):
            mask = mb["response_mask"]
            agg = _agg_totals(totals, a.loss_agg_mode, b.response_len)
            if a.policy_loss == "gspo":
                pg_loss, m = A.gspo_policy_loss(out["logprobs"], mb["old_logprobs"], mb["advantages"], mask, agg=a.loss_agg_mode, **agg)
            else:
                pg_loss, m = A.policy_loss(out["logprobs"], mb["old_logprobs"], mb["advantages"], mask, clip_ratio_low=low,
                                           clip_ratio_high=high, clip_ratio_c=a.clip_ratio_c, agg=a.loss_agg_mode, **agg)
            loss = pg_loss
            m = {**m, "actor/pg_loss": _local_loss_value(pg_loss, totals, mb)}
            if a.entropy_coeff > 0:
                ent = A.agg_loss(out["entropy"], mask, a.loss_agg_mode, **agg)
                loss = loss - a.entropy_coeff * ent
            if a.use_kl_loss:
                kl = A.agg_loss(A.kl_penalty(out["logprobs"], mb["ref_logprobs"], a.kl_loss_type), mask, a.loss_agg_mode, **agg)
                loss = loss + a.kl_loss_coef * kl
                m["actor/kl_loss"] = _local_loss_value(kl, totals, mb)
            return loss, m

        stats = self.actor.train_step(b, loss_fn, fields=fields, epochs=a.ppo_epochs, mini_batches=a.ppo_mini_batches,
                                      shuffle_seed=self._shuffle_seed(0), want=want, temperature=self.sampling.temperature,
                                      skip_grad_norm_above=self.cfg.guards.grad_norm_threshold or None)
        self.actor.offload()
        return {**stats.metrics, "actor/grad_norm": _mean(stats.grad_norms), "actor/skipped_steps": float(stats.skipped_steps)}

    # --- checks, guards, offload -----------------------------------------------------------------
    def _verify_sync(self, ro: Rollout, actor_logprobs: torch.Tensor, mask: torch.Tensor) -> None:
        """rollout.verify_weights: the engine's log-probs of its own samples (the probe batch) must
        equal the actor's, or the weight sync went wrong; raises WeightSyncMismatch."""
        truncated = self.cfg.rollout.top_k > 0 or self.cfg.rollout.top_p < 1.0
        if not self.cfg.rollout.verify_weights or (truncated and not ro.logprobs_are_scaled):
            return  # processed log-probs of a truncated distribution are not what the actor computes
        from megarl.hybrid.verify import compare_logprobs

        atol = 1e-3 if self.cfg.model.dtype == "float32" else 0.1
        compare_logprobs(ro.rollout_logprobs, actor_logprobs, mask, atol=atol)

    def _rollout_gap(self, ro: Rollout, actor_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        # verl's definition (|p_rollout - p_actor| per token), reduced over the global batch.
        from megarl.hybrid.verify import token_prob_diff

        diff = token_prob_diff(ro.rollout_logprobs, actor_logprobs, mask)
        return {"training/rollout_probs_diff_mean": self.global_batch.masked_mean(diff, mask),
                "training/rollout_probs_diff_max": self.global_batch.max(diff.reshape(-1))}

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
        return [engine for engine in (self.actor, self.critic, self.ref) if engine is not None]

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
        memory at the end of each phase, the maximum over ranks (one collective per step)."""
        phases = list(resident)
        t = torch.tensor([resident[p] for p in phases], dtype=torch.float64)
        if self.dims.world_size > 1:
            t = all_reduce_host(t, None, op=dist.ReduceOp.MAX)
        return {f"memory/resident_gb/{p.removeprefix('timing_s/')}": float(v) / 2**30 for p, v in zip(phases, t)}

    # --- seeds -----------------------------------------------------------------------------------
    def _shuffle_seed(self, role: int) -> int:
        return (self.cfg.trainer.seed * 1_000_003 + self.step) * 2 + role


# --- small helpers ------------------------------------------------------------------------------


def _scores_at_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[m] sequence scores -> [m, R] token rewards with the score on the last response token."""
    token = torch.zeros_like(mask)
    last = (mask.sum(-1).long() - 1).clamp_min(0)
    token[torch.arange(len(scores)), last] = scores * (mask.sum(-1) > 0)
    return token


def _agg_totals(totals: dict, mode: str, response_len: int) -> dict:
    return {"global_tokens": totals["tokens"], "global_seqs": totals["seqs"],
            "loss_scale_factor": float(response_len) if mode == "seq-mean-token-sum-norm" else None}


def _local_loss_value(loss: torch.Tensor, totals: dict, mb: dict) -> float:
    """A micro-batch's loss contribution expressed per token of the micro-batch, so that the
    engine's token-weighted average over micro-batches gives back the mini-batch loss."""
    tokens = float(mb["response_mask"].sum())
    return float(loss.detach()) * float(totals["tokens"]) / max(tokens, 1.0)


def _memory_metrics() -> dict[str, float]:
    import psutil

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
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        timing = self.clock.timing
        timing[self.name] = timing.get(self.name, 0.0) + time.perf_counter() - self.start
        if self.clock.after is not None and exc[0] is None:
            self.clock.after(self.name)
