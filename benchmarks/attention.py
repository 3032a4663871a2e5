"""Core attention alone: megarl's SDPA core attention against Megatron-Core's local one, same shapes.

    python benchmarks/attention.py --out benchmarks/results/attention_cpu.json

Forward + backward of causal GQA attention ([seq, batch, heads, head_dim]; the small preset's 8
heads, 4 groups, head size 32), alternated in one process; median seconds and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=(512, 1024))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.models.attention import SDPACoreAttention
    from megarl.models.packed_attention import PackedDotProductAttention
    from models.test_attention import config  # the unit test's TransformerConfig

    from megarl.distributed.parallel import ParallelDims, _free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    ParallelDims(world_size=1).initialize()  # Megatron's local attention needs its parallel state
    cfg = config(heads=8, groups=4, head_dim=32)
    sides = {"megarl_sdpa": SDPACoreAttention(cfg, 1, AttnMaskType.causal), "megatron_local": PackedDotProductAttention(cfg, 1, AttnMaskType.causal, "self")}
    result = {}
    for seq in args.seq_lens:
        b = args.tokens // seq
        q, k, v = (torch.randn(seq, b, h, 32, requires_grad=True) for h in (8, 4, 4))
        times = {name: [] for name in sides}
        for r in range(args.rounds + 1):
            for name, module in (sides.items() if r % 2 else reversed(sides.items())):
                start = time.perf_counter()
                module(q, k, v, None).sum().backward()
                if r:
                    times[name].append(time.perf_counter() - start)
        med = {n: statistics.median(t) for n, t in times.items()}
        result[str(seq)] = {**{f"seconds_{n}": round(t, 4) for n, t in med.items()},
                            "ratio_megarl_over_megatron": round(med["megarl_sdpa"] / med["megatron_local"], 3)}
    result.update(command="python benchmarks/attention.py " + " ".join(sys.argv[1:]), threads=torch.get_num_threads(),
                  machine={"processor": platform.machine(), "cpus": os.cpu_count()}, load_average_1_5_15=list(os.getloadavg()),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
