"""Run under torchrun (2 processes) by test_moe_routing.py: routing replay under each layout given.
For each: the hf engine records routes on the rollout model, the actor (other router weights)
replays them on this rank's rows; rank 0 writes, per layout, the log-probs of every row (gathered
over DP, in global order), the grad norm of one update and the largest ratio gap in that update.
Under tp the layout runs with sequence parallelism (megarl's default at tp > 1), where each TP rank
replays the routes of its own s/tp tokens; a layout ending in ",pad" runs padded micro-batches
instead of packed ones (their width rounded up to a multiple of tp)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from replay_cases import batch_of, forward_and_update, recorded_results  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rollout-model", required=True)
    p.add_argument("--actor-model", required=True)
    p.add_argument("--layouts", nargs="+", required=True, help="tp,pp,ep triples like 2,1,1, optionally ,pad")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig
    from megarl.models.moe_routing import RouterOptions
    from megarl.distributed.parallel import dims_from_env

    requests, results = recorded_results(Path(args.rollout_model))
    out = {}
    for layout in args.layouts:
        parts = layout.split(",")
        tp, pp, ep = (int(x) for x in parts[:3])
        dims = dims_from_env(tp=tp, pp=pp, ep=ep, sequence_parallel=True).initialize()
        cfg = EngineConfig(dtype="float32", routing=RouterOptions(replay=True), sequence_packing=parts[3:] != ["pad"],
                           optim=OptimConfig(lr=1e-2, weight_decay=0.0, max_grad_norm=0.0))
        engine = MegatronEngine(args.actor_model, dims, cfg)
        batch = batch_of(requests, results, dims.dp_rank, dims.dp)
        logprobs, grad_norm, gap = forward_and_update(engine, batch, num_global=len(results))
        rows: list = [None] * dims.world_size
        dist.all_gather_object(rows, (dims.dp_rank, logprobs))
        full = torch.zeros(len(results), logprobs.shape[1])
        for dp_rank, lp in rows:
            full[dp_rank::dims.dp] = lp
        gaps: list = [None] * dims.world_size
        dist.all_gather_object(gaps, gap)
        out[layout] = {"logprobs": full, "grad_norm": grad_norm, "gap": max(gaps)}
        del engine
        dims.destroy()
    if dist.get_rank() == 0:
        torch.save(out, args.out)


if __name__ == "__main__":
    main()
