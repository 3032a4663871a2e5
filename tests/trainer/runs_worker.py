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
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megarl.run import Run  # noqa: E402


def one_run(config: str, overrides: list[str]) -> None:
    run = Run.open(config, overrides)
    run.train(run.build_trainer())
    run.close()  # opened inside this script's process group, which stays up for the next run
    gc.collect()


def main() -> int:
    import torch.distributed as dist

    from megarl.platform import init_platform

    if "RANK" not in os.environ:  # plain `python runs_worker.py`: a world of one
        from megarl.distributed.parallel import _free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group(backend=init_platform().backend)  # this script's world, for every run
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--runs", required=True)
    args = p.parse_args()
    for overrides in json.loads(Path(args.runs).read_text()):
        one_run(args.config, overrides)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
