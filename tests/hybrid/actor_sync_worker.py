"""Run under torchrun by tests/hybrid/test_actor_sync.py.

For each model and training layout: a Megatron actor loaded from the HF directory (then perturbed,
so the test is not passed by the original checkpoint), its weights synced through the
HybridEngine into a fresh hf rollout engine, greedy responses generated; the actor is also
exported as an HF checkpoint. Rank 0 then loads that checkpoint with transformers and checks that
`generate` gives the same tokens.
"""
from __future__ import annotations

import argparse
import json
import zlib

import torch
import torch.distributed as dist

from megarl.engine.engine import EngineConfig, MegatronEngine
from megarl.hybrid import HybridEngine, RolloutLayout, TrainLayout
from megarl.models.convert import to_hf, weight_mappings
from megarl.models.weights import save_hf_checkpoint
from megarl.distributed.parallel import dims_from_env
from megarl.rollout import build_rollout_engine
from megarl.rollout.base import RolloutRequest, SamplingParams

PROMPTS = [[5, 6, 7], [11, 12, 40, 41], [3, 4, 5, 6, 7, 8], [42]]
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--layouts", nargs="+", required=True, help="tp,pp pairs")
    p.add_argument("--out", required=True)
    p.add_argument("--tmp", required=True)
    args = p.parse_args()
    results = []
    for model_dir in args.models:
        for layout in args.layouts:
            tp, pp = (int(x) for x in layout.split(","))
            dims = dims_from_env(tp=tp, pp=pp).initialize()
            actor = MegatronEngine(model_dir, dims, EngineConfig(), trainable=False)
            with torch.no_grad():  # a "trained" actor: noise drawn per full tensor, then sharded
                for name, (shard, meta) in actor.local_weight_shards().items():
                    seed = zlib.crc32(name.encode())  # same noise for a weight on every rank and layout
                    noise = torch.randn(meta.full_shape, generator=torch.Generator().manual_seed(seed)) * 0.02
                    shard.add_(meta.slice_of_full(noise))
            shards = actor.local_weight_shards()
            if actor.spec.tie_embeddings:
                shards.pop("output_layer.weight", None)
            maps = {m.name: m for m in weight_mappings(actor.spec, tp)}
            hybrid = HybridEngine(shards, train=TrainLayout(tp=tp, pp=pp, dp=dims.dp), rollout=RolloutLayout(tp=1),
                                  bucket_bytes=1 << 16, convert=lambda n, full: to_hf(maps[n], full))
            engine = build_rollout_engine("hf", model_dir)
            stats = hybrid.sync(engine, shards)
            outs = engine.generate([RolloutRequest(tuple(ids), i) for i, ids in enumerate(PROMPTS)], GREEDY)
            export_dir = f"{args.tmp}/{actor.spec.family}-tp{tp}-pp{pp}"
            save_hf_checkpoint(actor.module, actor.spec, dims, export_dir, model_dir)
            dist.barrier()
            entry = dict(model=actor.spec.family, tp=tp, pp=pp, export=export_dir,
                         engine_tokens=[o.response_token_ids for o in outs], sync_bytes=stats.bytes_received)
            gathered = [None] * dims.world_size
            dist.all_gather_object(gathered, entry["engine_tokens"])
            entry["ranks_agree"] = all(g == gathered[0] for g in gathered)
            results.append(entry)
            engine.close()
            dims.destroy()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
