"""Run under torchrun by test_sync_layouts.py (in .venv-vllm).

One real vLLM engine per job (rollout tp `--rollout-tp`: one TP2 engine over the 2 ranks, or two
TP1 replicas), built once; then for each training layout a Megatron actor is loaded, perturbed
(differently per layout, so every sync replaces weights the engine already holds), synced through
the HybridEngine with the layout the rollout builder returned, and asked for greedy responses; the
actor is exported as an HF checkpoint for the test to compare against transformers.
"""
from __future__ import annotations

import argparse
import json
import os
import zlib

import torch
import torch.distributed as dist

from megarl.engine.engine import EngineConfig, MegatronEngine
from megarl.hybrid import HybridEngine, TrainLayout
from megarl.models.convert import to_hf, weight_mappings
from megarl.models.weights import save_hf_checkpoint
from megarl.parallel import RolloutGroups, dims_from_env
from megarl.rollout import build_rollout
from megarl.rollout.base import RolloutRequest, SamplingParams

PROMPTS = [[5, 6, 7], [11, 12, 40, 41], [3, 4, 5, 6, 7, 8], [42]]
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--rollout-tp", type=int, required=True)
    p.add_argument("--layouts", nargs="+", required=True, help="tp,pp pairs (dp = world / (tp * pp))")
    p.add_argument("--out", required=True)
    p.add_argument("--tmp", required=True)
    args = p.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    results, setup = [], None
    for i, layout in enumerate(args.layouts):
        tp, pp = (int(x) for x in layout.split(","))
        dims = dims_from_env(tp=tp, pp=pp).initialize()  # the first call starts the default (gloo) group
        if setup is None:  # one engine for every layout: vLLM's groups are its own, not Megatron's
            setup = build_rollout("vllm", args.model, RolloutGroups.consecutive(args.rollout_tp), seed=0,
                                  dtype=torch.float32, max_model_len=64)
        actor = MegatronEngine(args.model, dims, EngineConfig(), trainable=False)
        with torch.no_grad():  # a "trained" actor: noise drawn per full tensor, then sharded
            for name, (shard, meta) in actor.local_weight_shards().items():
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * i)
                shard.add_(meta.slice_of_full(torch.randn(meta.full_shape, generator=g) * 0.05))
        shards = actor.local_weight_shards()
        if actor.spec.tie_embeddings:
            shards.pop("output_layer.weight", None)
        maps = {m.name: m for m in weight_mappings(actor.spec, tp)}
        hybrid = HybridEngine(shards, train=TrainLayout(tp=tp, pp=pp, dp=dims.dp), rollout=setup.weight_layout,
                              bucket_bytes=1 << 16, convert=lambda n, full: to_hf(maps[n], full))
        stats = hybrid.sync(setup.engine, shards)
        # every rank of an engine instance makes the same calls with the same prompts (lockstep)
        outs = setup.engine.generate([RolloutRequest(tuple(ids), k) for k, ids in enumerate(PROMPTS)], GREEDY)
        export_dir = f"{args.tmp}/export-{i}-tp{tp}-pp{pp}"
        save_hf_checkpoint(actor.module, actor.spec, dims, export_dir, args.model)
        dist.barrier()
        mine = dict(tokens=[o.response_token_ids for o in outs], logprobs=[o.logprobs for o in outs])
        gathered = [None] * dims.world_size
        dist.all_gather_object(gathered, mine)
        results.append(dict(tp=tp, pp=pp, dp=dims.dp, export=export_dir, per_rank=gathered, sync_bytes=stats.bytes_received,
                            rollout_group=list(setup.groups.ranks)))
        dims.destroy()
    setup.engine.close()
    assert dist.is_initialized(), "closing the vLLM engine destroyed the trainer's default process group"
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
