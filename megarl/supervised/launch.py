"""The entry of launch/sft.py and launch/reward_model.py: light to import (the config is checked, exit 2 in
about a second, before torch.distributed, Megatron and the trainer load; megarl.run stages its imports so)."""
from __future__ import annotations

import argparse

from megarl.run import Refused, Run

STAGES = {"sft": "supervised fine-tuning", "reward_model": "reward-model training"}


def main(stage: str, argv=None) -> int:
    """One supervised stage's run ('sft' or 'reward_model'); the exit code (2: refused, said in one line)."""
    p = argparse.ArgumentParser(description=f"megarl {STAGES[stage]}", epilog="overrides: dotted key=value pairs")
    p.add_argument("--config", required=True, help="YAML config (configs/tiny_cpu_sft.yaml, configs/tiny_cpu_rm.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=10")
    args = p.parse_args(argv)

    def make_trainer(cfg, dims, separate):
        # deferred: the trainer (Megatron): a refused config exits 2 before it loads
        from megarl.supervised.trainer import SupervisedTrainer

        return SupervisedTrainer(cfg, dims, stage, separate=separate)

    try:
        run = Run.open(args.config, args.overrides)  # config, process groups, run-dir lock, demo model
        trainer = run.build_trainer(make_trainer)  # resumed where trainer.resume says, config changes checked
        run.train(trainer)  # the steps with the tracker, the preemption watch and the heartbeat
    except Refused:
        return 2
    run.close()
    return 0
