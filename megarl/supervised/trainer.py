"""The loop of the supervised stages: SFT (`launch/sft.py`) and reward-model training (`launch/reward_model.py`).

    torchrun --standalone --nproc_per_node N launch/sft.py --config configs/tiny_cpu_sft.yaml [key=value ...]
    torchrun --standalone --nproc_per_node N launch/reward_model.py --config configs/tiny_cpu_rm.yaml [key=value ...]

A run's life (config check, process groups, run-directory lock, resume decision, tracker, preemption)
is megarl.run.Run's, as for PPO; this module owns only the steps. A step is one optimizer step over
supervised.rows_per_step rows of data.train_files (megarl.supervised.data orders them); every
trainer.val_every_steps steps (and at the last) the whole of data.val_files is scored.

Checkpoints are PPO's (megarl.checkpointing.checkpoint): `<run_dir>/checkpoints/step_N/` with the trained engine
under its PPO role's name (SFT: `actor/`, the policy; reward model: `critic/`, a scalar-head model)
and `trainer.pt` (step, data position, stage). `python -m megarl.tools.export_hf --ckpt` exports
either (the reward model as a transformers `*ForSequenceClassification`).
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from megarl.checkpointing import checkpoint

from megarl.runtime import heartbeat
from megarl.platform.safe_load import load_plain
from megarl.config import Config
from megarl.data.tokenizer import load_tokenizer
from megarl.engine.engine import MegatronEngine
from megarl.step.global_batch import GlobalBatch
from megarl.distributed.parallel import ParallelDims
from megarl.runtime.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionWatch
from megarl.supervised.data import RowOrder, read_rows
from megarl.supervised.tasks import RewardTask, SftTask
from megarl.step.engine_options import engine_config


def make_task(stage: str, tokenizer):
    """The stage's task: 'sft' or 'reward_model'."""
    if stage == "sft":
        return SftTask()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    return RewardTask(pad)


class SupervisedTrainer:
    """One supervised stage on this rank: its engine, its data and its step counter (Stateful, as megarl.trainer.Trainer)."""

    def __init__(self, cfg: Config, dims: ParallelDims, stage: str, log=print, separate=None):
        if separate is not None:
            raise ValueError("rollout.placement=separate is for PPO: the supervised stages generate nothing (set it to colocated)")
        self.cfg, self.dims, self.stage, self.log = cfg, dims, stage, log
        t, s = cfg.trainer, cfg.supervised
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.task = make_task(stage, self.tokenizer)
        rank0_log = log if dims.rank == 0 else (lambda _: None)
        self.rows = read_rows(cfg.data.train_files, self.task.data_kind, self.tokenizer, s.max_length, s.bad_rows, rank0_log)
        self.val_rows = (read_rows(cfg.data.val_files, self.task.data_kind, self.tokenizer, s.max_length, s.bad_rows, rank0_log)
                         if t.val_every_steps and cfg.data.val_files else None)
        self.order = RowOrder(len(self.rows), s.rows_per_step, dims.dp_rank, dims.dp, t.seed, shuffle=cfg.data.shuffle)
        model_dir = cfg.model.path if self.task.role == "actor" else (cfg.critic.model_path or cfg.model.path)
        # one optimizer step per trainer step: the role's schedule counts both alike
        engine_cfg = replace(engine_config(cfg, self.task.role, t.total_steps, updates_per_step=1),
                             train_value_head_bias=self.task.trains_value_head_bias)
        self.engine = MegatronEngine(model_dir, dims, engine_cfg, value_head=self.task.value_head, seed=t.seed)
        self._check_vocab()
        self.global_batch = GlobalBatch(dims)
        self.step = 0  # steps completed

    def _check_vocab(self) -> None:
        vocab = self.engine.spec.vocab_size
        for rows, key in ((self.rows, "data.train_files"), (self.val_rows or [], "data.val_files")):
            for row in rows:
                ids = [t for seq in vars(row).values() for t in seq]
                if ids and max(ids) >= vocab:
                    raise ValueError(f"{key}: a row has token id {max(ids)}, but the model has {vocab} tokens: the tokenizer in "
                                     f"model.path does not belong to its model")

    # --- the loop and its state ---------------------------------------------------------------------
    def train(self, tracker, watch: PreemptionWatch) -> None:
        """Steps step+1 .. trainer.total_steps, validation, checkpoints; after a step in which `watch` caught
        SIGTERM / SIGUSR1 on any rank, its checkpoint and Preempted. Collective: every rank calls it."""
        run = self.cfg.trainer
        while self.step < run.total_steps:
            self.step += 1
            heartbeat.enter("step", self.step)
            last = self.step == run.total_steps
            started = time.perf_counter()
            examples = [self.rows[r] for r in self.order.next_step()]
            metrics = self.task.train(self.engine, examples, self.order.my_block, self.global_batch)
            metrics[f"{self.task.prefix}/lr"] = self.engine.lr
            metrics["data/epoch"] = float(self.order.epoch)
            metrics["timing_s/step"] = time.perf_counter() - started
            if self.val_rows is not None and (self.step % run.val_every_steps == 0 or last):
                heartbeat.enter("validate")
                metrics.update(self.validate())
            tracker.log(metrics, step=self.step)
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
                watch.keep_until_exit = True
                raise Preempted(self.step, signame)

    def validate(self) -> dict[str, float]:
        """The task's validation metrics over all of data.val_files (val/sft/* or val/rm/*)."""
        return self.task.evaluate(self.engine, self.val_rows, self.cfg.supervised.rows_per_step, self.dims)

    def resume(self, start: Path) -> None:
        """Load the checkpoint `start` (megarl.run.Run decides which) into the engine and this trainer."""
        stage = load_plain(Path(start) / "trainer.pt").get("stage") if (Path(start) / "trainer.pt").is_file() else self.stage
        if stage != self.stage:  # before the engines load: a PPO checkpoint's roles would be refused less clearly
            raise ValueError(f"trainer.resume: {start} is a checkpoint of stage {stage or 'ppo'}, not {self.stage}: resume a "
                             f"{self.stage} run from its own checkpoints (or start one with trainer.resume=never)")
        checkpoint.restore(self, start)

    def checkpointed_engines(self) -> dict[str, MegatronEngine]:
        return {self.task.role: self.engine}

    def state_dict(self) -> dict:
        return {"step": self.step, "stage": self.stage, "data": self.order.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.order.load_state_dict(state["data"])
