"""PPO / RLHF training with megarl.

    torchrun --standalone --nproc_per_node N launch/ppo.py --config configs/X.yaml [key=value ...]
    python launch/ppo.py --config configs/X.yaml [key=value ...]          # one process

Everything about the run is in the config (see docs/configuration.md); `key=value` overrides any
field, e.g. `trainer.total_steps=10 actor.optim.lr=1e-6`. Configuration mistakes are reported in
one line with exit code 2, before any process group or model is built. A model named by hub id
(`model.path=Qwen/Qwen2.5-0.5B-Instruct`) is fetched once per node after the process groups exist.
The run's life (lock, resume, tracker, preemption) is megarl/run.py's; the loop is megarl/trainer.py's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run from a checkout without installing: make `megarl` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megarl.tools import dryrun  # noqa: E402  (light: argparse only until a dry run starts)


def parse_args(argv):
    p = argparse.ArgumentParser(description="megarl PPO trainer", epilog="overrides: dotted key=value pairs")
    p.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=10")
    return dryrun.parse_with_dry_run(p, argv)  # adds --dry-run --world-size N [--ranks] [--json]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:  # megarl/tools/dryrun.py; docs/operations.md, "Before the cluster: the dry run"
        return dryrun.run(args.config, args.world_size, args.overrides, args.ranks, args.json)
    from megarl.run import Refused, Run  # light: torch.distributed, Megatron and the trainer load after the config check

    try:
        run = Run.open(args.config, args.overrides)  # config, process groups, run-dir lock, data, hub models
        if run.serves_rollout:  # rollout.placement=separate: this rank only generates
            return run.serve_rollout()
        trainer = run.build_trainer()  # resumed where trainer.resume says, config changes checked
        run.train(trainer)  # Trainer.train with the tracker, the preemption watch and the heartbeat
    except Refused:  # already said in one line
        return 2
    run.close()
    return 0


if __name__ == "__main__":  # the guard matters: Megatron's checkpoint writer spawns processes
    sys.exit(main())
