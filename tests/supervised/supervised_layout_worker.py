"""Run under torchrun by tests/supervised/test_supervised_layouts.py: SFT and reward-model training for 3 steps
under each layout of one set, in one process-group lifetime (groups rebuilt per layout), each saving a checkpoint
at step 2. Every rank's metrics by step to --out (rank 0 writes), keyed "<stage>/<variant>/<layout>".

  --set base (2 ranks): the dense model at tp2 with sequence parallelism, pp2, dp2 and cp2; then, as a resume
                        across a layout change, step 3 again at pp2 from dp2's step-2 checkpoint
  --set more (2 ranks): the tiny MoE model at pp2 x vpp2 (interleaved 1F1B) and at ep2; LoRA at tp2 with SP
  --set cp_sp (4 ranks): the dense model at cp2 x tp2 with sequence parallelism"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from supervised_helpers import VARIANTS, config, train  # noqa: E402

import torch.distributed as dist  # noqa: E402

from megarl.distributed.parallel import dims_from_env  # noqa: E402

# set -> layout name -> (model variant of supervised_helpers.VARIANTS, ParallelDims degrees)
LAYOUTS = {
    "base": {"tp2_sp": ("dense", dict(tp=2, sequence_parallel=True)), "pp2": ("dense", dict(pp=2)),
             "dp2": ("dense", dict()), "cp2": ("dense", dict(cp=2))},
    "more": {"pp2_vpp2": ("moe", dict(pp=2, vpp=2)), "ep2": ("moe", dict(ep=2)),
             "tp2_sp": ("lora", dict(tp=2, sequence_parallel=True))},
    "cp_sp": {"cp2_tp2_sp": ("dense", dict(cp=2, tp=2, sequence_parallel=True))},
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--inputs", required=True, help="JSON of supervised_helpers.make_inputs")
    p.add_argument("--set", default="base", choices=sorted(LAYOUTS))
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    inputs = json.loads(Path(args.inputs).read_text())
    result = {}
    for stage in ("sft", "reward_model"):
        for name, (variant, layout) in LAYOUTS[args.set].items():
            dims = dims_from_env(**layout).initialize(seed=3)
            cfg = config(inputs, stage, f"{args.work}/{stage}_{variant}_{name}", *VARIANTS[variant](inputs, stage))
            result[f"{stage}/{variant}/{name}"] = train(cfg, dims, stage)
            dims.destroy()
        if args.set == "base":
            dims = dims_from_env(pp=2).initialize(seed=3)
            cfg = config(inputs, stage, f"{args.work}/{stage}_resumed")
            result[f"{stage}/dense/resumed_pp2_from_dp2"] = train(
                cfg, dims, stage, resume_from=f"{args.work}/{stage}_dense_dp2/checkpoints/step_00000002")
            dims.destroy()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # Megatron's checkpoint writer spawns processes
    main()
