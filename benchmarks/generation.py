"""megarl's HF rollout engine against transformers' `generate` on the same batch and lengths.

    python benchmarks/generation.py --out benchmarks/results/generation_hf_cpu.json [--rounds 5]

One process, the CPU demo's model (runs/bench/tiny-llama-digits, made by `make bench` or the demo)
and prompts: 32 prompts x 16 samples = 512 rows, decoded in calls of --rows rows (the engine's
max_batch_rows, 64 in the trainer) by both, every row sampling --new-tokens tokens at temperature 1
with the demo's banned tokens (transformers: `suppress_tokens`, `min_new_tokens` so that both decode
the same lengths; megarl: no stop token). megarl runs as in a trainer process: the CPU platform's
Megatron-Core seams applied (megarl.platform), transformers as a plain script runs it. The two
alternate, the order flipping every round. Written: median CPU and wall seconds of each over the
512 rows and their ratio, megarl over transformers (<= 1.0: at least as fast), with the load average.
megarl also returns per-token log-probs and draws every row from its own seeded generator
(layout-independent sampling); transformers does neither.
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

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=REPO / "runs" / "bench" / "tiny-llama-digits")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--rows", type=int, default=64, help="rows per call (the engine's max_batch_rows)")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"error: no model at {args.model}; run `make bench` (or the demo) first, or pass --model DIR")

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.platform import init_platform
    from megarl.platform.cpu_compat import device_rewrite_paused
    from megarl.rollout.base import RolloutRequest, SamplingParams
    from megarl.rollout.hf import HFRolloutEngine

    init_platform(force_cpu=True)  # as in a trainer process on CPU: the Megatron-Core seams are applied
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    engine = HFRolloutEngine(model, device="cpu", max_batch_rows=args.rows)
    banned = [0, 1, 3]  # rollout.banned_token_ids of configs/tiny_cpu.yaml
    texts = [f"{i:03d}=" for i in range(100, 100 + 7 * args.prompts, 7)]
    prompt_ids = [tokenizer.encode(t) for t in texts]
    sampling = SamplingParams(n=args.samples, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens,
                              stop_token_ids=(), banned_token_ids=tuple(banned))
    requests = [RolloutRequest(tuple(ids), prompt_index=i, step=0) for i, ids in enumerate(prompt_ids)]
    rows = torch.tensor([ids for ids in prompt_ids for _ in range(args.samples)])  # equal lengths: no padding

    def megarl() -> int:
        results = engine.generate(requests, sampling)
        return sum(len(r.response_token_ids) for r in results)

    def transformers() -> int:
        made = 0
        with device_rewrite_paused(), torch.no_grad():  # a plain script: no Megatron seams
            for start in range(0, len(rows), args.rows):
                batch = rows[start:start + args.rows]
                out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True, temperature=1.0, top_k=0,
                                     top_p=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                     suppress_tokens=banned, pad_token_id=tokenizer.pad_token_id)
                made += (out.shape[1] - batch.shape[1]) * len(batch)
        return made

    sides = {"megarl": megarl, "transformers": transformers}
    tokens = {side: fn() for side, fn in sides.items()}  # warm-up
    if tokens["megarl"] != tokens["transformers"]:
        raise SystemExit(f"the two sides decoded different token counts: {tokens}")
    load_before = list(os.getloadavg())
    cpu = {side: [] for side in sides}
    wall = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in (("megarl", "transformers") if r % 2 == 0 else ("transformers", "megarl")):
            c, w = time.process_time(), time.perf_counter()
            sides[side]()
            cpu[side].append(time.process_time() - c)
            wall[side].append(time.perf_counter() - w)
    med = {side: {"cpu_s": statistics.median(cpu[side]), "wall_s": statistics.median(wall[side])} for side in sides}
    result = {
        "ratio_megarl_over_transformers_cpu": med["megarl"]["cpu_s"] / med["transformers"]["cpu_s"],
        "ratio_megarl_over_transformers_wall": med["megarl"]["wall_s"] / med["transformers"]["wall_s"],
        "median": med, "cpu_s": cpu, "wall_s": wall, "generated_tokens_per_call": tokens["megarl"],
        "rows": len(rows), "rows_per_call": args.rows, "new_tokens": args.new_tokens,
        "command": f"python benchmarks/generation.py --rows {args.rows} --new-tokens {args.new_tokens} --rounds {args.rounds} --out {args.out}",
        "load_average_1_5_15": {"before": load_before, "after": list(os.getloadavg())},
        "machine": {"processor": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(), "threads": 1},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("ratio_megarl_over_transformers_cpu", "ratio_megarl_over_transformers_wall", "median")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
