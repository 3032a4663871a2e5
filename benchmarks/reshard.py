"""Weight-sync benchmark: megarl's 3D-HybridEngine against the naive per-tensor all-gather.

    torchrun --standalone --nproc_per_node 4 benchmarks/reshard.py \
        --train-tp 4 --train-pp 1 --rollout-tp 2 --out result.json

One run measures both methods on the same synthetic Megatron-style model (size set by flags),
alternating them `--repeats` times after a warm-up, and writes JSON with the HybridFlow lower
bound, bucket size, largest tensor and, per method, the max over ranks of bytes received,
instrumented peak extra memory (plus CUDA's max_memory_allocated on GPU) and median seconds.
Backend: NCCL when CUDA is available, else gloo on CPU (then keep sizes small: ~100 MB).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megarl.hybrid.engine import HybridEngine
from megarl.hybrid.layout import RolloutLayout, TrainLayout, hybridflow_bytes_per_rank
from naive_allgather import NaiveAllGather  # benchmarks/naive_allgather.py
from synthetic_model import SyntheticModel, synthetic_shards  # benchmarks/synthetic_model.py


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train-tp", type=int, required=True)
    p.add_argument("--train-pp", type=int, default=1)
    p.add_argument("--rollout-tp", type=int, default=1)
    p.add_argument("--grouping", choices=["micro_dp", "consecutive"], default="micro_dp")
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--ffn-hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--bucket-mb", type=float, default=16.0, help="bucket size in MiB")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method (after one warm-up each)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: each rank's process CPU seconds, max over ranks (robust to other load on a shared machine)")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def drain(stream) -> int:
    """Consume a weight stream the way an engine's load_weights would (one pass, nothing kept)."""
    n = 0
    for _, t in stream:
        n += t.numel()
    return n


def main(argv=None) -> None:
    args = parse_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)  # several ranks share a few cores
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mp = args.train_tp * args.train_pp
    if world % mp:
        raise ValueError(f"world size {world} is not divisible by train tp {args.train_tp} x pp {args.train_pp} = {mp}")
    train = TrainLayout(tp=args.train_tp, pp=args.train_pp, dp=world // mp)
    model = SyntheticModel(num_layers=args.num_layers, hidden=args.hidden, ffn_hidden=args.ffn_hidden, vocab=args.vocab,
                           dtype=getattr(torch, args.dtype))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    local, _ = synthetic_shards(model, train, rank)
    local = {k: (t.to(device), m) for k, (t, m) in local.items()}
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    hybrid = HybridEngine(local, train=train, rollout=RolloutLayout(args.rollout_tp, args.grouping), bucket_bytes=bucket_bytes, device=device)
    naive = NaiveAllGather(local, train=train, device=device)

    def timed(method) -> tuple[float, object]:
        dist.barrier()
        t0 = clock()
        drain(method.stream())
        dist.barrier()
        return clock() - t0, method.last_stats

    seconds = {"megarl": [], "naive": []}
    stats = {}
    for i in range(args.repeats + 1):  # alternate, so load changes on a shared machine hit both
        for name, method in (("megarl", hybrid), ("naive", naive)):
            dt, st = timed(method)
            if i > 0:
                seconds[name].append(dt)
            stats[name] = st
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, {k: vars(v) for k, v in stats.items()})
    if args.clock == "cpu":  # CPU seconds are per process: a transition costs what its busiest rank spends
        all_seconds: list = [None] * world
        dist.all_gather_object(all_seconds, seconds)
        seconds = {name: [max(s[name][i] for s in all_seconds) for i in range(len(seconds[name]))] for name in seconds}
    if rank == 0:
        lower = hybridflow_bytes_per_rank(model.nbytes, train, args.rollout_tp)
        out = {
            "lower_bound_bytes_per_rank": lower,
            "exact_lower_bound_bytes_per_rank_max": max(hybrid.plan.min_recv_bytes),
            "bucket_bytes": bucket_bytes,
            "largest_tensor_bytes": hybrid.plan.largest_tensor_bytes,
            "model_bytes": model.nbytes,
        }
        for name in ("megarl", "naive"):
            rows = [r[name] for r in per_rank]
            cuda_peaks = [r["cuda_peak_extra_bytes"] for r in rows if r["cuda_peak_extra_bytes"] is not None]
            out[name] = {
                "bytes_received_per_rank_max": max(r["bytes_received"] for r in rows),
                "bytes_received_per_rank": [r["bytes_received"] for r in rows],
                "peak_extra_bytes_max": max(r["peak_extra_bytes"] for r in rows),
                "cuda_peak_extra_bytes_max": max(cuda_peaks) if cuda_peaks else None,
                "collectives_per_rank_max": max(r["collectives"] for r in rows),
                "seconds": statistics.median(seconds[name]),
                "seconds_all": seconds[name],
            }
        m, n = out["megarl"], out["naive"]
        out["checks"] = {
            "bytes_within_5pct_of_lower_bound": m["bytes_received_per_rank_max"] <= 1.05 * lower,
            "peak_within_bucket_plus_largest_tensor": m["peak_extra_bytes_max"] <= bucket_bytes + out["largest_tensor_bytes"],
            "faster_than_naive": m["seconds"] < n["seconds"],
        }
        out["config"] = {
            "train": {"tp": train.tp, "pp": train.pp, "dp": train.dp}, "rollout_tp": args.rollout_tp, "grouping": args.grouping,
            "world_size": world, "model": {"num_layers": args.num_layers, "hidden": args.hidden, "ffn_hidden": args.ffn_hidden,
                                           "vocab": args.vocab, "dtype": args.dtype},
            "backend": dist.get_backend(), "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "torchrun --nproc_per_node %d %s" % (world, " ".join(sys.argv)),
            "naive": "per tensor: PP-group broadcast of the owner's shard, then TP-group all_gather (verl per_tensor_generator)",
        }
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        print(json.dumps({k: out[k] for k in ("lower_bound_bytes_per_rank", "checks")} |
                         {k: {kk: out[k][kk] for kk in ("bytes_received_per_rank_max", "peak_extra_bytes_max", "seconds")} for k in ("megarl", "naive")}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
