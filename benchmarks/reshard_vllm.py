"""Weight sync into real vLLM: bytes received per rank by the direct path and the full-tensor path,
against the bound (each rank's rollout shard minus what it already holds).

    .venv-vllm/bin/torchrun --standalone --nproc_per_node 2 benchmarks/reshard_vllm.py \
        --rollout-tp 2 --layouts 2,1 1,2 1,1 --out benchmarks/results/reshard_vllm_cpu.json

One vLLM engine (rollout tp `--rollout-tp` over consecutive ranks) and, per training layout
("tp,pp", dp = world / (tp * pp)), a Megatron actor of a random llama (built here with
make_tiny_model; `--hidden`, `--layers`, `--vocab`). Each layout is synced twice into the same
engine: the direct path (megarl.rollout.vllm_direct: each rank's rollout shard written into vLLM's
sharded parameters) and the full-tensor path (full HF tensors into vLLM's reload_weights, which
slices them per rank); after each, greedy responses to a few prompts, which must agree. Bytes are
exact counts from the HybridEngine (what crossed the wire into the rank); the bound is the plan's
per-rank minimum for the direct layout. Needs vllm (`make venv-vllm`); runs on CPU with gloo.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

PROMPTS = [[5, 6, 7], [11, 12, 40, 41], [3, 4, 5, 6, 7, 8]]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rollout-tp", type=int, default=2)
    p.add_argument("--layouts", nargs="+", default=["2,1", "1,2", "1,1"], help="train tp,pp pairs")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4000)
    p.add_argument("--model-dir", default="/tmp/megarl_reshard_vllm_model")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from megarl.engine.engine import EngineConfig, MegatronEngine
    from megarl.hybrid import HybridEngine, TrainLayout
    from megarl.hybrid.layout import RolloutLayout
    from megarl.models.convert import to_hf, weight_mappings
    from megarl.distributed.parallel import RolloutGroups, dims_from_env
    from megarl.rollout import build_rollout
    from megarl.rollout.base import RolloutRequest, SamplingParams
    from megarl.tools.make_tiny_model import make_tiny_model

    model_dir = Path(args.model_dir)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    rows, setup = [], None
    for layout in args.layouts:
        tp, pp = (int(x) for x in layout.split(","))
        dims = dims_from_env(tp=tp, pp=pp).initialize()
        if setup is None:
            if dims.rank == 0 and not (model_dir / "config.json").exists():  # head_dim 64: vLLM's CPU kernel takes it
                make_tiny_model("llama", model_dir, hidden=args.hidden, intermediate=2 * args.hidden, layers=args.layers,
                                heads=args.hidden // 64, kv_heads=args.hidden // 128, vocab_size=args.vocab, max_positions=256, tie=False)
            dist.barrier()
            setup = build_rollout("vllm", str(model_dir), RolloutGroups.consecutive(args.rollout_tp), dtype=torch.float32,
                                  max_model_len=64, train_tp=tp)
            if setup.weight_path != "direct":
                raise RuntimeError(f"the direct path did not apply: {setup.weight_path_reason}")
        actor = MegatronEngine(str(model_dir), dims, EngineConfig(), trainable=False)
        shards = actor.local_weight_shards()
        maps = {m.name: m for m in weight_mappings(actor.spec, tp)}
        train = TrainLayout(tp=tp, pp=pp, dp=dims.dp)
        paths = {
            "direct": (HybridEngine(shards, train=train, rollout=setup.weight_layout, convert=setup.convert), "direct"),
            "full": (HybridEngine(shards, train=train, rollout=RolloutLayout(tp=1), convert=lambda n, full: to_hf(maps[n], full)), "hf"),
        }
        row = {"train": {"tp": tp, "pp": pp, "dp": dims.dp}}
        tokens = {}
        for name, (hybrid, fmt) in paths.items():
            setup.engine.weight_format = fmt
            dist.barrier()
            t0 = time.perf_counter()
            stats = hybrid.sync(setup.engine, shards)
            seconds = time.perf_counter() - t0
            outs = setup.engine.generate([RolloutRequest(tuple(p), k) for k, p in enumerate(PROMPTS)], greedy)
            tokens[name] = [o.response_token_ids for o in outs]
            mine = {"bytes_received": stats.bytes_received, "bound_bytes": hybrid.plan.min_recv_bytes[dims.rank],
                    "rollout_shard_bytes": hybrid.plan.needed_bytes[dims.rank], "seconds": seconds}
            per_rank: list = [None] * dims.world_size
            dist.all_gather_object(per_rank, mine)
            row[name] = {k: [r[k] for r in per_rank] for k in mine}
        setup.engine.weight_format = "direct"
        same: list = [None] * dims.world_size
        dist.all_gather_object(same, tokens["direct"] == tokens["full"])
        bound = row["direct"]["bound_bytes"]  # per rank
        direct = row["direct"]["bytes_received"]
        row["checks"] = {
            "direct_within_1.05x_of_bound": all(d <= 1.05 * b for d, b in zip(direct, bound)),
            "direct_and_full_greedy_agree": all(same),
        }
        row["direct_over_bound"] = [d / b if b else (1.0 if d == 0 else float("inf")) for d, b in zip(direct, bound)]
        row["full_over_direct_bytes"] = [f / d if d else None for f, d in zip(row["full"]["bytes_received"], direct)]
        rows.append(row)
        del actor
        dims.destroy()
    setup.engine.close()
    if dist.get_rank() == 0:
        spec = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "family": "llama (untied)", "dtype": "float32"}
        out = {
            "results": rows, "rollout_tp": args.rollout_tp, "model": spec,
            "config": {"world_size": dist.get_world_size(), "backend": dist.get_backend(),
                       "device": _cpu_name(), "cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "torch": torch.__version__,
                       "vllm": __import__("vllm").__version__,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "command": "torchrun --standalone --nproc_per_node %d %s" % (dist.get_world_size(), " ".join(sys.argv))},
        }
        Path(args.out).write_text(json.dumps(out, indent=2))
        for r in rows:
            t = r["train"]
            print(f"train tp{t['tp']} pp{t['pp']} dp{t['dp']} -> rollout tp{args.rollout_tp}: bound {r['direct']['bound_bytes']}, "
                  f"direct {r['direct']['bytes_received']}, full {r['full']['bytes_received']}, checks {r['checks']}")
    dist.barrier()
    dist.destroy_process_group()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


if __name__ == "__main__":
    main()
