"""The run's life around a `Trainer`: everything before its first step and after its last.

    run = Run.open(config_path, overrides)  # config checked, process groups, run-directory lock,
                                            # demo data and tiny model, models named by hub id
    trainer = run.build_trainer()           # where it resumes (a LoRA checkpoint's base checked first), the
                                            # Trainer; what changed in the config
                                            # since, abandoned checkpoints aside, config.yaml, segment record
    run.train(trainer)                      # the tracker, the preemption watch and the heartbeat around
                                            # Trainer.train
    run.close()                             # process groups down, the lock released

A Run opened inside a process group that already exists (a test world, a user's own launcher) leaves
that group up when it closes: it ends only the groups it started (Megatron's always; the default group
when it started it).

This is the one module that takes the run-directory lock and decides where a run resumes
(tests/docs/test_house_rules.py checks that no other module does). Every refusal is printed once,
in one line, by rank 0 (by the first rank while no process group exists yet), then `Refused` is
raised on every rank: launch/ppo.py exits 2.

Imports are staged on purpose: the warnings filter goes on before Megatron loads, and the config is
checked (exit 2 within about a second) before a process group starts and before Megatron and the
trainer are imported (torch is, by the warnings filter of megarl.platform), so the heavy imports sit
inside the methods that need them.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

from megarl import hub
from megarl.async_rollout import placement
from megarl.capacity import memory_check as memory
from megarl.checkpointing.checkpoint_io import RunDirLock, RunDirLocked, abandon_newer, remove_leftovers
from megarl.config import ConfigError, check_inputs, flatten, load_config, save_resolved, validate
from megarl.config.inputs import check_model_layout, model_refs, with_snapshots
from megarl.config.resume_changes import ResumeChangeError, check_resume, record_segment
from megarl.models import base_ref
from megarl.rewards import RewardError
from megarl.runtime import heartbeat
from megarl.tracking import Tracker


class Refused(Exception):
    """The run cannot start or go on; one rank has printed why, in one line (exit code 2)."""


def check_config(config_path: str | None, overrides: list[str], world_size: int):
    """The config loaded and checked before any process group exists -> (cfg, sizes); Refused on a mistake."""
    first_rank = os.environ.get("RANK", "0") == "0"  # under torchrun every rank checks: one prints
    try:
        cfg = load_config(config_path, overrides)
        sizes = validate(cfg, world_size)
        check_inputs(cfg, overrides)
        # colocated vLLM/SGLang on CUDA: will the engine's budget fit beside the training state from
        # step 2 on? Decides the offloads left null (megarl/capacity/memory_check.py)
        cfg, memory_note = memory.check_colocated_memory(cfg, world_size)
        if memory_note and first_rank:
            print(memory_note, flush=True)
    except ConfigError as err:
        if first_rank:
            print(f"config error: {err}", file=sys.stderr, flush=True)
        else:
            # torchrun stops the remaining workers as soon as one exits: were another rank to exit
            # first, rank 0 could be killed before printing. (No process group exists yet to wait on.)
            time.sleep(3)
        raise Refused(str(err)) from None
    return cfg, sizes


def prepare_inputs(cfg, user_files=()) -> None:
    """What the demo needs, created by the caller (rank 0) when missing: the tiny model and the dataset."""
    # deferred: megarl.data loads pyarrow and numpy, not needed to check a config
    from megarl.data.prepare import prepare_if_missing

    if cfg.model.make_tiny.enable and not os.path.isdir(cfg.model.path):
        # deferred: torch (the tiny model), needed only for the demo model
        from megarl.tools.make_tiny_model import make_tiny_model

        options = asdict(cfg.model.make_tiny)
        options.pop("enable")
        arch, seed = options.pop("arch"), options.pop("seed")
        make_tiny_model(arch, cfg.model.path, seed=seed, **options)
        print(f"created a tiny random {arch} model at {cfg.model.path}", flush=True)
    if prepare_if_missing(cfg.data, user_files):
        print(f"prepared {cfg.data.auto_prepare} data at {cfg.data.train_files[0]}", flush=True)


class Run:
    """One segment of a run (a process lifetime) in trainer.run_dir; collective: every rank calls each method."""

    def __init__(self, cfg, sizes, overrides: list[str], dims, separate=None):
        """dims: the training ranks' layout, None on a rank that only generates; separate: the world
        split of rollout.placement=separate (megarl.async_rollout.placement.WorldGroups), None when colocated."""
        import torch.distributed as dist  # deferred: torch; `import megarl.run` stays torch-free

        self.cfg, self.sizes, self.overrides, self.dims, self.separate = cfg, sizes, list(overrides), dims, separate
        self.rank = dims.rank if dims is not None else dist.get_rank()
        self.run_dir = Path(cfg.trainer.run_dir)
        self.lock = None  # rank 0's RunDirLock, held until close() or the process ends (kill -9 included)
        self.snapshots: dict = {}  # config key -> hub snapshot, for models named by hub id
        self.records: dict = {}  # flat config plus the hub commits: the tracker's params, the segment record
        self.start: Path | None = None  # the checkpoint this segment resumed from
        self.owns_process_group = True  # open() started torch.distributed (else the caller's to end)

    # --- before the trainer -------------------------------------------------------------------------
    @classmethod
    def open(cls, config_path: str | None, overrides: list[str]) -> "Run":
        """Config check (before any process group), process groups, lock, demo inputs, hub models."""
        from megarl.platform import quiet_known_warnings  # deferred: torch (megarl.platform imports it)

        quiet_known_warnings()
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        cfg, sizes = check_config(config_path, overrides, world_size)
        import torch.distributed as dist  # deferred: torch; `import megarl.run` stays torch-free

        owns_process_group = not dist.is_initialized()
        separate = None
        if cfg.rollout.placement == "separate":  # the last rollout.num_ranks ranks only generate (megarl/async_rollout/placement.py)
            separate = placement.start(cfg, world_size)
            if separate.placement.is_rollout(dist.get_rank()):
                run = cls(cfg, sizes, overrides, None, separate)  # serve_rollout() is all it does
                run.owns_process_group = owns_process_group
                return run
            world_size = separate.placement.train_size
        from megarl.distributed.parallel import ParallelDims  # deferred: torch (megarl.distributed imports it)

        layout = cfg.parallel
        dims = ParallelDims(world_size=world_size, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, etp=layout.etp,
                            vpp=layout.vpp, first_stage_layers=layout.first_stage_layers,
                            last_stage_layers=layout.last_stage_layers, sequence_parallel=layout.sequence_parallel)
        dims.initialize(seed=cfg.trainer.seed)
        run = cls(cfg, sizes, overrides, dims, separate)
        run.owns_process_group = owns_process_group
        run._lock()
        run._prepare()
        run._fetch_models()
        return run

    @property
    def serves_rollout(self) -> bool:
        """True on a rank of rollout.placement=separate that only runs the rollout engine."""
        return self.dims is None

    def serve_rollout(self) -> int:
        """A rollout rank's whole life: serve the trainers until they stop it; the exit code."""
        import torch.distributed as dist  # deferred: torch; `import megarl.run` stays torch-free

        from megarl.async_rollout.server import run_rollout_rank  # deferred: torch (the rollout server)

        code = run_rollout_rank(self.cfg, self.separate, self.rank)
        if self.owns_process_group:
            dist.destroy_process_group()
        return code

    def _fail(self, problem: str | None) -> None:
        """Every rank learns rank 0's verdict; rank 0 prints it once; Refused on every rank when there is one."""
        import torch.distributed as dist  # deferred: torch; `import megarl.run` stays torch-free

        verdict = [problem]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            if self.rank == 0:
                print(f"error: {verdict[0]}", file=sys.stderr)
            raise Refused(verdict[0])

    def _refuse(self, err: Exception) -> NoReturn:
        """An error every rank raised together: rank 0 prints it; Refused on every rank."""
        if self.rank == 0:
            print(f"error: {err}", file=sys.stderr)
        raise Refused(str(err)) from None

    def _lock(self) -> None:
        """One run per run_dir: rank 0 holds the lock until this process ends."""
        problem = None
        if self.rank == 0:
            try:
                self.lock = RunDirLock(self.run_dir).acquire()
            except RunDirLocked as err:
                problem = str(err)
            except OSError as err:
                problem = (f"trainer.run_dir {self.run_dir} cannot be written ({err.strerror or err}): check that the "
                           f"filesystem is writable and not full, or choose another trainer.run_dir")
        self._fail(problem)

    def _prepare(self) -> None:
        """Rank 0 creates the demo's tiny model and data when missing (a path typed on the command
        line is never generated); the others wait for its verdict."""
        # deferred: megarl.data loads pyarrow and numpy, not needed to check a config
        from megarl.data.prepare import user_data_files

        problem = None
        if self.rank == 0:
            try:
                prepare_inputs(self.cfg, user_data_files(self.cfg.data, self.overrides))
            except (ValueError, OSError) as err:
                problem = str(err)
        self._fail(problem)

    def _fetch_models(self) -> None:
        """Models named by hub id: fetched once per node (a collective), then the layout check that
        config validation had to skip while model.path's config.json was not yet here."""
        problem = None
        if model_refs(self.cfg):
            self.snapshots, problem = hub.resolve_on_each_node(model_refs(self.cfg))
            if problem is None and self.rank == 0:
                try:
                    check_model_layout(self.cfg, {key: snap.path for key, snap in self.snapshots.items()})
                except ConfigError as err:
                    problem = str(err)
        self._fail(problem)
        self.records = {**flatten(self.cfg), **hub.recorded(self.snapshots)}  # ids as given, and their commits
        if self.rank == 0:
            for key, snap in self.snapshots.items():
                print(f"{key}: {snap.repo_id} at commit {snap.revision} ({snap.path})", flush=True)
            print(f"megarl: {self.dims.describe()} | {self.sizes}", flush=True)

    # --- the trainer and where it resumes -----------------------------------------------------------
    def build_trainer(self, make_trainer=None):
        """The Trainer, resumed from the checkpoint trainer.resume names (auto: the newest complete one)
        after the config-change check; config.yaml and this segment's record written. make_trainer(cfg,
        dims, separate): another stage's trainer (megarl.supervised: SFT, reward model); None = PPO's."""
        from megarl.checkpointing import checkpoint  # deferred: torch (megarl.checkpointing.checkpoint imports it)
        from megarl.trainer import Trainer  # deferred: torch and Megatron (the trainer)

        t = self.cfg.trainer
        world_size = self.dims.world_size
        cfg = with_snapshots(self.cfg, self.snapshots)
        self.start = self._resume_point()
        self._fail(self._changed_lora_base(cfg) if self.rank == 0 else None)  # before any model is built
        try:
            trainer = (make_trainer or Trainer)(cfg, self.dims, separate=self.separate)
        except (ValueError, FileNotFoundError, ImportError) as err:  # bad data / model files, missing engine
            self._refuse(err)
        start, problem, changes = self.start, None, []
        if self.rank == 0:
            try:  # a changed config on resume is shown, and refused where it breaks exact resume, before loading
                if start is not None:
                    changes = check_resume(self.run_dir, self.records, world_size, t.resume_allow_changes)
            except ResumeChangeError as err:
                problem = str(err)
        self._fail(problem)
        try:
            if start is not None:
                trainer.resume(start)
        except (ValueError, FileNotFoundError) as err:  # checkpoint of another model, release or optimizer setup
            self._refuse(err)
        if self.rank == 0:
            if start is not None:
                print(f"resumed from {start} (step {trainer.step})", flush=True)
                for line in changes:
                    print(f"  changed since the last segment: {line}", flush=True)
                # resuming from an older checkpoint of this run: its newer ones belong to a trajectory
                # that this segment abandons (moved aside, so that resume=auto never picks them up)
                root = checkpoint.checkpoints_root(self.run_dir)
                if t.resume not in ("auto", "never") and Path(start).resolve().parent == root.resolve():
                    for moved in abandon_newer(root, trainer.step):
                        print(f"  newer checkpoint of the abandoned trajectory moved to {moved}", flush=True)
            save_resolved(self.cfg, self.run_dir / "config.yaml", footer=hub.describe(self.snapshots))
            record_segment(self.run_dir, self.records, (self.run_dir / "config.yaml").read_text(), trainer.step + 1,
                           world_size)
        return trainer

    def _changed_lora_base(self, cfg) -> str | None:
        """A LoRA checkpoint holds only adapters: the base it names (path and content hash,
        megarl.models.base_ref) must be the base this run builds, or the refusal."""
        if self.start is None:
            return None
        critic_key = "critic.model_path" if cfg.critic.model_path else "model.path"
        bases = {"actor": ("model.path", cfg.model.path), "critic": (critic_key, cfg.critic.model_path or cfg.model.path)}
        for role, (key, model_dir) in bases.items():
            if getattr(cfg, role).lora.rank > 0 and (self.start / role).is_dir():
                problem = base_ref.changed_base(self.start / role, model_dir, key)
                if problem is not None:
                    return problem
        return None

    def _resume_point(self) -> Path | None:
        """trainer.resume: 'auto' -> the newest complete checkpoint (or None), 'never' -> None, else
        that path. Collective under 'auto': rank 0 first clears what a killed save left behind."""
        import torch.distributed as dist  # deferred: torch; `import megarl.run` stays torch-free

        # deferred: torch (megarl.checkpointing.checkpoint imports it)
        from megarl.checkpointing.checkpoint import checkpoints_root, latest_checkpoint

        resume = self.cfg.trainer.resume
        if resume == "never":
            return None
        if resume == "auto":
            if self.rank == 0:
                remove_leftovers(checkpoints_root(self.run_dir))  # temp dirs of a save that was killed
            dist.barrier()
            return latest_checkpoint(self.run_dir)
        return Path(resume)

    # --- the loop's surroundings --------------------------------------------------------------------
    def train(self, trainer) -> None:
        """Trainer.train with rank 0's loggers, the preemption watch and the heartbeat; a run ended by
        a signal raises Preempted (exit 75) after its checkpoint, past this method."""
        from megarl.step.dynamic_sampling import NotEnoughGroups  # deferred: torch (megarl.step imports it)

        problem, tracker = None, None
        try:  # rank 0's loggers: a missing package or a busy metrics port is one line, exit 2, on every rank
            tracker = Tracker(self.cfg.tracking, self.run_dir, rank=self.rank, total_steps=self.cfg.trainer.total_steps,
                              start_step=trainer.step + 1, resume=self.start is not None, params=self.records,
                              log_every=self.cfg.trainer.log_every)
        except (ValueError, ImportError) as err:
            problem = str(err)
        self._fail(problem)
        status = "FAILED"
        try:
            with self._watched() as watch:
                trainer.train(tracker, watch)
            status = "FINISHED"
        except (RewardError, NotEnoughGroups) as err:  # raised on every rank together (both checks are collective)
            self._refuse(err)
        finally:
            tracker.close(status)

    @contextlib.contextmanager
    def _watched(self):
        """SIGTERM / SIGUSR1 caught for a stop at a step boundary (megarl/runtime/preemption.py), and this rank's
        heartbeat with its watchdog (megarl/runtime/heartbeat.py), for the duration of the loop."""
        from megarl.runtime.preemption import PreemptionWatch  # deferred: torch (megarl.runtime.preemption imports it)

        watch = PreemptionWatch().install()
        beat = heartbeat.start_for_world(self.cfg.trainer.collective_timeout_s, self.rank, self.dims.world_size,
                                         separate=self.separate)
        try:
            yield watch
        finally:
            watch.uninstall()
            if beat is not None:
                beat.stop()

    def close(self) -> None:
        """After a finished run: the process groups down (collective), the run-directory lock released."""
        import torch.distributed as dist  # deferred: torch; `import megarl.run` stays torch-free

        dist.barrier()
        self.dims.destroy()
        if self.owns_process_group:  # else the world it was opened in goes on (a test world, a user's launcher)
            dist.destroy_process_group()
        if self.lock is not None:
            self.lock.release()
