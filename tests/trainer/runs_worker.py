"""Several launch/ppo.py runs in one process lifetime (tests/trainer/test_lora_runs.py): the
imports and the process group are paid once per launch, not once per run. Each run is what
launch/ppo.py does with its config and overrides (megarl.run.Run), except that the process group
stays up between runs: only Megatron's groups are rebuilt for the next layout.

    [torchrun --nproc_per_node N] tests/trainer/runs_worker.py --config C --runs RUNS.json

RUNS.json: a list of override lists, one per run (each names its own trainer.run_dir)."""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megarl.run import Run  # noqa: E402


def one_run(config: str, overrides: list[str]) -> None:
    import torch.distributed as dist

    run = Run.open(config, overrides)
    run.train(run.build_trainer())
    dist.barrier()
    run.dims.destroy()  # Run.close without destroy_process_group: the next run reuses the group
    if run.lock is not None:
        run.lock.release()
    gc.collect()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--runs", required=True)
    args = p.parse_args()
    for overrides in json.loads(Path(args.runs).read_text()):
        one_run(args.config, overrides)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
