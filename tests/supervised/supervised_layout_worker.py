"""Run under torchrun (2 ranks) by tests/supervised/test_supervised_layouts.py: SFT and reward-model
training for 3 steps at tp2 with sequence parallelism, pp2, dp2 and cp2, in one process-group lifetime
(groups rebuilt per layout), each saving a checkpoint at step 2; then, as a resume across a layout change,
step 3 again at pp2 from dp2's step-2 checkpoint. Every rank's metrics by step to --out (rank 0 writes)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from supervised_helpers import config, train  # noqa: E402

import torch.distributed as dist  # noqa: E402

from megarl.parallel import dims_from_env  # noqa: E402

LAYOUTS = {"tp2_sp": dict(tp=2, sequence_parallel=True), "pp2": dict(pp=2), "dp2": dict(), "cp2": dict(cp=2)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--inputs", required=True, help="JSON of supervised_helpers.make_inputs")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    inputs = json.loads(Path(args.inputs).read_text())
    result = {}
    for stage in ("sft", "reward_model"):
        for name, layout in LAYOUTS.items():
            dims = dims_from_env(**layout).initialize(seed=3)
            cfg = config(inputs, stage, f"{args.work}/{stage}_{name}")
            result[f"{stage}/{name}"] = train(cfg, dims, stage)
            dims.destroy()
        dims = dims_from_env(pp=2).initialize(seed=3)
        cfg = config(inputs, stage, f"{args.work}/{stage}_resumed")
        result[f"{stage}/resumed_pp2_from_dp2"] = train(cfg, dims, stage, resume_from=f"{args.work}/{stage}_dp2/checkpoints/step_00000002")
        dims.destroy()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # Megatron's checkpoint writer spawns processes
    main()
