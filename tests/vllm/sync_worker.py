"""Run under torchrun by test_sync_layouts.py (in .venv-vllm).

One real vLLM engine per job (rollout tp `--rollout-tp`: one TP2 engine over the 2 ranks, or two
TP1 replicas), built once; then for each training layout a Megatron actor is loaded, perturbed
(differently per layout, so every sync replaces weights the engine already holds), synced through
the HybridEngine with the layout the rollout builder returned (the direct path for this llama:
each rank's rollout shard written into vLLM's parameters), and asked for greedy responses; the
actor is exported as an HF checkpoint for the test to compare against transformers. Per sync the
rank's bytes received are recorded beside the bound (its rollout shard minus what it holds) and
beside the bytes of vLLM's own parameters on the rank. With --corrupt, the first layout is synced
once more with one rank's down_proj shard scaled x1.5 (greedy output recorded as "corrupted"),
before its correct sync.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import zlib

import torch
import torch.distributed as dist

from megarl.engine.engine import EngineConfig, MegatronEngine
from megarl.hybrid import HybridEngine, TrainLayout
from megarl.models.weights import save_hf_checkpoint
from megarl.distributed.parallel import RolloutGroups, dims_from_env
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
    p.add_argument("--corrupt", action="store_true")
    p.add_argument("--weight-sync", choices=("full", "delta"), default="full",
                   help="delta: a full sync first, then the actor moves (a small step on a tenth of the elements) and "
                        "the synced weights go by delta (rollout.weight_sync.mode=delta)")
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
        hybrid = HybridEngine(shards, train=TrainLayout(tp=tp, pp=pp, dp=dims.dp), rollout=setup.weight_layout,
                              bucket_bytes=1 << 16, convert=setup.convert, mode=args.weight_sync)
        corrupted = None
        if args.corrupt and i == 0:  # one rank's shard of one layer scaled: the sync check must see it
            hybrid.convert = _corrupting(setup.convert, rank=dims.world_size - 1)
            hybrid.sync(setup.engine, shards)
            corrupted = _greedy(setup.engine)
            hybrid.convert = setup.convert
        if args.weight_sync == "delta":
            hybrid.sync(setup.engine, shards)  # the full one
            with torch.no_grad():  # a PPO-sized step on the live parameters: the export below sees it
                for name, (shard, meta) in shards.items():
                    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 31 + i)
                    moved = meta.slice_of_full(torch.rand(meta.full_shape, generator=g) < 0.1)
                    shard.add_(moved * 1e-3)
        stats = hybrid.sync(setup.engine, shards)
        # every rank of an engine instance makes the same calls with the same prompts (lockstep)
        outs = setup.engine.generate([RolloutRequest(tuple(ids), k) for k, ids in enumerate(PROMPTS)], GREEDY)
        export_dir = f"{args.tmp}/export-{i}-tp{tp}-pp{pp}"
        save_hf_checkpoint(actor.module, actor.spec, dims, export_dir, args.model)
        dist.barrier()
        mine = dict(tokens=[o.response_token_ids for o in outs], logprobs=[o.logprobs for o in outs], corrupted=corrupted,
                    bytes_received=stats.full_bytes_received if args.weight_sync == "delta" else stats.bytes_received,
                    delta_bytes=stats.bytes_received, went_as_delta=not stats.full,
                    changed_fraction=stats.changed_fraction, bound_bytes=hybrid.plan.min_recv_bytes[dims.rank],
                    needed_bytes=hybrid.plan.needed_bytes[dims.rank], vllm_shard_bytes=vllm_shard_bytes(setup.engine))
        gathered = [None] * dims.world_size
        dist.all_gather_object(gathered, mine)
        results.append(dict(tp=tp, pp=pp, dp=dims.dp, export=export_dir, per_rank=gathered, weight_path=setup.weight_path,
                            rollout_group=list(setup.groups.ranks)))
        dims.destroy()
    setup.engine.close()
    assert dist.is_initialized(), "closing the vLLM engine destroyed the trainer's default process group"
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _greedy(engine) -> dict:
    outs = engine.generate([RolloutRequest(tuple(ids), k) for k, ids in enumerate(PROMPTS)], GREEDY)
    return dict(tokens=[o.response_token_ids for o in outs], logprobs=[o.logprobs for o in outs])


def _corrupting(convert, rank: int):
    def corrupt(name, shard):
        out = convert(name, shard)
        if dist.get_rank() == rank and name == "decoder.layers.1.mlp.linear_fc2.weight":
            out = [(n, t * 1.5) for n, t in out]
        return out

    return corrupt


def vllm_shard_bytes(engine) -> int:
    """Bytes of vLLM's parameters on this rank, vocabulary padding rows left out (nobody sends those)."""
    desc = engine.describe_model()
    total = sum(4 * math.prod(shape) for shape in desc["params"].values())  # float32
    vocab = desc["vocab"]
    lo, hi = vocab["rows"]
    for name, shape in desc["params"].items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            total -= 4 * (shape[0] - (hi - lo)) * shape[1]
    return total


if __name__ == "__main__":
    main()
