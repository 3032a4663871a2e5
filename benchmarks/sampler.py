"""Per-decode-step sampler cost at a real vocabulary: one cumulative sum against the former two.

    python benchmarks/sampler.py --out benchmarks/results/sampler_cpu.json

Times, alternated in one run, megarl.rollout.sampling (process_logits + sample_rows) against the
same logit processing followed by the former sampler (a second cumulative sum over the vocabulary
to find each row's last positive token), at --vocab (151,936: Qwen2/3) and --rows, for plain
sampling (temperature only), top-k and top-p. Both must pick the same tokens (checked here too).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from megarl.rollout.sampling import process_logits, sample_rows


def former_sample_rows(processed_logprobs, generators):
    u = torch.zeros(len(generators), 1, dtype=torch.float64)
    for i, g in enumerate(generators):
        u[i, 0] = torch.rand((), generator=g, dtype=torch.float64)
    probs = processed_logprobs.double().exp()
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, u.to(cdf.device) * cdf[:, -1:], right=True).squeeze(-1)
    last_positive = (probs > 0).cumsum(dim=-1).argmax(dim=-1)
    return torch.minimum(idx, last_positive)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 2
    result = {}
    for name, (top_k, top_p) in {"temperature": (0, 1.0), "top_k_50": (50, 1.0), "top_p_0.9": (0, 0.9)}.items():
        times = {"megarl": [], "former": []}
        for step in range(args.steps + 1):
            gens = lambda: [torch.Generator().manual_seed(step * 1000 + r) for r in range(args.rows)]  # noqa: E731
            picked = {}
            for side in (("megarl", "former") if step % 2 else ("former", "megarl")):
                start = time.perf_counter()
                processed, _ = process_logits(logits, 0.8, top_k, top_p)
                picked[side] = (sample_rows(processed, gens(), greedy=False) if side == "megarl"
                                else former_sample_rows(processed, gens()))
                if step:  # the first step warms up
                    times[side].append(time.perf_counter() - start)
            assert torch.equal(picked["megarl"], picked["former"]), "samplers disagree"
        med = {k: statistics.median(v) for k, v in times.items()}
        result[name] = {"ms_per_step_megarl": round(1e3 * med["megarl"], 2), "ms_per_step_former": round(1e3 * med["former"], 2),
                        "ratio_megarl_over_former": round(med["megarl"] / med["former"], 3)}
    result.update(vocab=args.vocab, rows=args.rows, steps=args.steps, threads=torch.get_num_threads(),
                  command=f"python benchmarks/sampler.py --vocab {args.vocab} --rows {args.rows} --steps {args.steps} --out {args.out}",
                  machine={"processor": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
                  load_average_1_5_15=list(os.getloadavg()), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  note="time of one decode step's logit processing + sampling; the same tokens are asserted for both")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
