"""PPO / RLHF training with megarl.

    torchrun --standalone --nproc_per_node N launch/ppo.py --config configs/X.yaml [key=value ...]
    python launch/ppo.py --config configs/X.yaml [key=value ...]          # one process

Everything about the run is in the config (see docs/configuration.md); `key=value` overrides any
field, e.g. `trainer.total_steps=10 actor.optim.lr=1e-6`. Configuration mistakes are reported in
one line with exit code 2, before any process group or model is built. A model named by hub id
(`model.path=Qwen/Qwen2.5-0.5B-Instruct`) is fetched once per node after the process groups exist
(megarl.hub); validation before them only looks in the cache.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

# Run from a checkout without installing: make `megarl` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv):
    p = argparse.ArgumentParser(description="megarl PPO trainer", epilog="overrides: dotted key=value pairs")
    p.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=10")
    return p.parse_args(argv)


def prepare(cfg, rank: int, user_files=()) -> None:
    """Rank 0 creates what the demo needs: the tiny model and the dataset (others wait)."""
    if rank != 0:
        return
    from megarl.data.prepare import prepare_if_missing

    if cfg.model.make_tiny.enable and not os.path.isdir(cfg.model.path):
        from megarl.tools.make_tiny_model import make_tiny_model

        options = asdict(cfg.model.make_tiny)
        options.pop("enable")
        arch, seed = options.pop("arch"), options.pop("seed")
        make_tiny_model(arch, cfg.model.path, seed=seed, **options)
        print(f"created a tiny random {arch} model at {cfg.model.path}", flush=True)
    if prepare_if_missing(cfg.data, user_files):
        print(f"prepared {cfg.data.auto_prepare} data at {cfg.data.train_files[0]}", flush=True)


def main(argv=None) -> int:
    # megarl is imported in stages on purpose: the warnings filter before Megatron loads, and the
    # config checked (exit 2 in about a second) before torch.distributed, Megatron and the trainer.
    args = parse_args(argv)
    from megarl.platform import quiet_known_warnings

    quiet_known_warnings()
    from megarl.config import ConfigError, check_inputs, flatten, load_config, save_resolved, validate

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    first_rank = os.environ.get("RANK", "0") == "0"  # under torchrun every rank checks: one prints
    try:
        cfg = load_config(args.config, args.overrides)
        sizes = validate(cfg, world_size)
        check_inputs(cfg, args.overrides)
        # colocated vLLM/SGLang on CUDA: will the engine's budget fit beside the training state from
        # step 2 on? Decides the offloads left null (megarl/config/memory.py)
        from megarl.config import memory

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
        return 2

    import torch.distributed as dist

    from megarl import hub
    from megarl.checkpoint import checkpoints_root
    from megarl.checkpoint_io import RunDirLock, RunDirLocked, abandon_newer
    from megarl.config.inputs import check_model_layout, model_refs, with_snapshots
    from megarl.data.prepare import user_data_files
    from megarl.dynamic_sampling import NotEnoughGroups
    from megarl.parallel import ParallelDims
    from megarl.resume_changes import ResumeChangeError, check_resume, record_segment
    from megarl.rewards import RewardError
    from megarl.tracking import Tracker
    from megarl.trainer import Trainer

    layout = cfg.parallel
    dims = ParallelDims(world_size=world_size, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, etp=layout.etp,
                        vpp=layout.vpp, first_stage_layers=layout.first_stage_layers,
                        last_stage_layers=layout.last_stage_layers, sequence_parallel=layout.sequence_parallel)
    dims.initialize(seed=cfg.trainer.seed)
    rank = dims.rank
    run_dir = Path(cfg.trainer.run_dir)

    def fail(problem: str | None) -> bool:
        """Every rank learns rank 0's verdict; rank 0 prints it once. True: stop (exit 2)."""
        verdict = [problem]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None and rank == 0:
            print(f"error: {verdict[0]}", file=sys.stderr)
        return verdict[0] is not None

    lock, problem = None, None
    if rank == 0:  # one run per run_dir, held until this process ends (kill -9 included)
        try:
            lock = RunDirLock(run_dir).acquire()
        except RunDirLocked as err:
            problem = str(err)
        except OSError as err:
            problem = (f"trainer.run_dir {run_dir} cannot be written ({err.strerror or err}): check that the "
                       f"filesystem is writable and not full, or choose another trainer.run_dir")
    if fail(problem):
        return 2
    problem = None
    if rank == 0:
        try:
            prepare(cfg, rank, user_data_files(cfg.data, args.overrides))
        except (ValueError, OSError) as err:
            problem = str(err)
    if fail(problem):
        return 2
    # Models named by hub id: fetched once per node (a collective), then the layout check that
    # config validation had to skip while model.path's config.json was not yet here.
    snapshots, problem = {}, None
    if model_refs(cfg):
        snapshots, problem = hub.resolve_on_each_node(model_refs(cfg))
        if problem is None and rank == 0:
            try:
                check_model_layout(cfg, {key: snap.path for key, snap in snapshots.items()})
            except ConfigError as err:
                problem = str(err)
    if fail(problem):
        return 2
    records = {**flatten(cfg), **hub.recorded(snapshots)}  # the ids as given, and the commits they resolved to
    if rank == 0:
        for key, snap in snapshots.items():
            print(f"{key}: {snap.repo_id} at commit {snap.revision} ({snap.path})", flush=True)
        print(f"megarl: {dims.describe()} | {sizes}", flush=True)

    try:
        trainer = Trainer(with_snapshots(cfg, snapshots), dims)
        start = trainer.resume_point()
    except (ValueError, FileNotFoundError, ImportError) as err:  # bad data / model files, missing engine
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    problem, changes = None, []
    if rank == 0:
        try:  # a changed config on resume is shown, and refused where it breaks exact resume, before loading
            if start is not None:
                changes = check_resume(run_dir, records, world_size, cfg.trainer.resume_allow_changes)
        except ResumeChangeError as err:
            problem = str(err)
    if fail(problem):
        return 2
    try:
        if start is not None:
            trainer.resume(start)
    except (ValueError, FileNotFoundError) as err:  # checkpoint of another model, release or optimizer setup
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    if rank == 0:
        if start is not None:
            print(f"resumed from {start} (step {trainer.step})", flush=True)
            for line in changes:
                print(f"  changed since the last segment: {line}", flush=True)
            if cfg.trainer.resume not in ("auto", "never") and Path(start).resolve().parent == checkpoints_root(run_dir).resolve():
                for moved in abandon_newer(checkpoints_root(run_dir), trainer.step):
                    print(f"  newer checkpoint of the abandoned trajectory moved to {moved}", flush=True)
        save_resolved(cfg, run_dir / "config.yaml", footer=hub.describe(snapshots))
        record_segment(run_dir, records, (run_dir / "config.yaml").read_text(), trainer.step + 1, world_size)
    problem, tracker = None, None
    try:  # rank 0's loggers: a missing package or a busy metrics port is one line, exit 2, on every rank
        tracker = Tracker(cfg.tracking, run_dir, rank=rank, total_steps=cfg.trainer.total_steps, start_step=trainer.step + 1,
                          resume=start is not None, params=records, log_every=cfg.trainer.log_every)
    except (ValueError, ImportError) as err:
        problem = str(err)
    if fail(problem):
        return 2
    status = "FAILED"
    try:
        trainer.train(tracker)
        status = "FINISHED"
    except (RewardError, NotEnoughGroups) as err:  # raised on every rank together (both checks are collective)
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        tracker.close(status)
    dist.barrier()
    dims.destroy()
    dist.destroy_process_group()
    if lock is not None:
        lock.release()
    return 0


if __name__ == "__main__":  # the guard matters: Megatron's checkpoint writer spawns processes
    sys.exit(main())
