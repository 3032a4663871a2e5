"""PPO / RLHF training with megarl.

    torchrun --standalone --nproc_per_node N launch/ppo.py --config configs/X.yaml [key=value ...]
    python launch/ppo.py --config configs/X.yaml [key=value ...]          # one process

Everything about the run is in the config (see docs/configuration.md); `key=value` overrides any
field, e.g. `trainer.total_steps=10 actor.optim.lr=1e-6`. Configuration mistakes are reported in
one line with exit code 2, before any process group or model is built.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Run from a checkout without installing: make `megarl` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv):
    p = argparse.ArgumentParser(description="megarl PPO trainer", epilog="overrides: dotted key=value pairs")
    p.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=10")
    return p.parse_args(argv)


def check_inputs(cfg) -> None:
    """Problems a user can fix without a traceback: missing model or data files."""
    from megarl.config import ConfigError

    if not os.path.isdir(cfg.model.path) and not cfg.model.make_tiny.enable:
        raise ConfigError(f"model.path: {cfg.model.path} does not exist (give a Hugging Face model directory, "
                          f"or set model.make_tiny.enable=true for a tiny random model)")
    if cfg.data.auto_prepare is None:
        for path in cfg.data.train_files:
            if not os.path.isfile(path):
                raise ConfigError(f"data.train_files: {path} does not exist (write it with launch/prepare_data.py, "
                                  f"or set data.auto_prepare)")


def prepare(cfg, rank: int) -> None:
    """Rank 0 creates what the demo needs: the tiny model and the dataset (others wait)."""
    if rank != 0:
        return
    from megarl.data.prepare import prepare_if_missing

    if cfg.model.make_tiny.enable and not os.path.isdir(cfg.model.path):
        from dataclasses import asdict

        from megarl.tools.make_tiny_model import make_tiny_model

        options = asdict(cfg.model.make_tiny)
        options.pop("enable")
        arch, seed = options.pop("arch"), options.pop("seed")
        make_tiny_model(arch, cfg.model.path, seed=seed, **options)
        print(f"created a tiny random {arch} model at {cfg.model.path}", flush=True)
    if prepare_if_missing(cfg.data):
        print(f"prepared {cfg.data.auto_prepare} data at {cfg.data.train_files[0]}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megarl.platform import quiet_known_warnings

    quiet_known_warnings()
    from megarl.config import ConfigError, flatten, load_config, save_resolved, validate

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = load_config(args.config, args.overrides)
        sizes = validate(cfg, world_size)
        check_inputs(cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2

    import torch.distributed as dist

    from megarl import checkpoint
    from megarl.parallel import ParallelDims
    from megarl.tracking import Tracker
    from megarl.trainer import Trainer

    p = cfg.parallel
    dims = ParallelDims(world_size=world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, vpp=p.vpp)
    dims.initialize(seed=cfg.trainer.seed)
    rank = dims.rank
    prepare(cfg, rank)
    dist.barrier()
    run_dir = Path(cfg.trainer.run_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_resolved(cfg, run_dir / "config.yaml")
        print(f"megarl: {dims.describe()} | {sizes}", flush=True)

    try:
        trainer = Trainer(cfg, dims)
    except (ValueError, FileNotFoundError) as err:  # bad data / model files found while building
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    start = checkpoint.resume_point(run_dir, cfg.trainer.resume)
    if start is not None:
        from megarl.platform.mcore_version import CheckpointVersionError

        try:
            trainer.step = checkpoint.restore(trainer, start)
        except CheckpointVersionError as err:  # written by a Megatron-Core whose format this one cannot read
            if rank == 0:
                print(f"error: {err}", file=sys.stderr)
            return 2
        if rank == 0:
            print(f"resumed from {start} (step {trainer.step})", flush=True)
    tracker = Tracker(cfg.tracking, run_dir, rank=rank, total_steps=cfg.trainer.total_steps, start_step=trainer.step + 1,
                      resume=start is not None, params=flatten(cfg), log_every=cfg.trainer.log_every)
    status = "FAILED"
    try:
        while trainer.step < cfg.trainer.total_steps:
            trainer.step += 1
            metrics = trainer.ppo_step()
            val_every = cfg.trainer.val_every_steps
            if trainer.val_data is not None and (trainer.step % val_every == 0 or trainer.step == cfg.trainer.total_steps):
                metrics.update(trainer.validate())
            tracker.log(metrics, step=trainer.step)
            for name, fields in trainer._pending_events:
                tracker.event(name, step=trainer.step, **fields)
            every = cfg.trainer.save_every_steps
            if every and (trainer.step % every == 0 or trainer.step == cfg.trainer.total_steps):
                checkpoint.save(trainer, trainer.step)
        status = "FINISHED"
    finally:
        tracker.close(status)
    dist.barrier()
    dims.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # the guard matters: Megatron's checkpoint writer spawns processes
    sys.exit(main())
