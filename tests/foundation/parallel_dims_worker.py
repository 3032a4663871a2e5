"""Run under torchrun (4 processes) by test_parallel_dims.py: for each layout, every rank reports
its groups; rank 0 writes them as JSON to --out."""
from __future__ import annotations

import argparse
import json

import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", nargs="+", required=True, help="tp,pp,ep triples like 2,2,1")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from megarl.distributed.parallel import dims_from_env

    results = {}
    for layout in args.layouts:
        tp, pp, ep = (int(x) for x in layout.split(","))
        dims = dims_from_env(tp=tp, pp=pp, ep=ep).initialize()
        mine = dict(
            coordinates=dims.coordinates(),
            tp_group=dist.get_process_group_ranks(dims.tp_group),
            pp_stage_ranks=dims.pp_stage_ranks(),
            dp_group=dist.get_process_group_ranks(dims.dp_group),
            mp_group=dist.get_process_group_ranks(dims.mp_group),
            ep_group=dist.get_process_group_ranks(dims.ep_group),
            is_first_stage=dims.is_first_stage,
            is_last_stage=dims.is_last_stage,
            dp=dims.dp,
            all_coordinates=dims.all_coordinates(),
        )
        gathered: list = [None] * dims.world_size
        dist.all_gather_object(gathered, mine)
        results[layout] = gathered
        dims.destroy()
    # A ParallelDims built for another world size is refused once torch.distributed is up.
    from megarl.distributed.parallel import ParallelDims

    try:
        ParallelDims(world_size=8, tp=2).initialize()
        results["wrong_world_error"] = None
    except ValueError as err:
        results["wrong_world_error"] = str(err)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
