"""Sequence packing vs padded micro-batches: actor update throughput on ragged sequences, side by side.

    python benchmarks/packing.py --out benchmarks/results/packing_cpu.json
    torchrun --standalone --nproc_per_node 1 benchmarks/packing.py --preset 1b --out benchmarks/results/packing_h200.json

One process builds two engines from the same random Llama-style model, one packing and one padding,
and times the same step (old log-probs by forward_only, then one train_step) on the same ragged
batch, alternating packed/padded `--rounds` times so machine noise hits both alike. Reports the
median seconds of each, their ratio, and the padding each layout feeds the model. Lengths follow
RLHF rollouts: prompts of `--prompt` tokens +- 50%, responses uniform in [8, `--response`].
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from _common import PRESETS, device_name, finish, random_llama  # benchmarks/_common.py


def ragged_batch(n: int, prompt: int, response: int, vocab: int, rank: int):
    from megarl.engine.batch import SequenceBatch

    g = torch.Generator().manual_seed(rank)
    seqs, prompt_lens = [], []
    mask = torch.zeros(n, response)
    for i in range(n):
        p = int(torch.randint(prompt // 2, prompt * 3 // 2 + 1, (1,), generator=g))
        r = int(torch.randint(8, response + 1, (1,), generator=g))
        seqs.append(torch.randint(0, vocab, (p + r,), generator=g).tolist())
        prompt_lens.append(p)
        mask[i, :r] = 1
    tensors = {"response_mask": mask, "advantages": torch.randn(n, response, generator=g)}
    return SequenceBatch(seqs, prompt_lens, [rank * n + i for i in range(n)], response, tensors)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=PRESETS, default="small")
    p.add_argument("--sequences", type=int, default=32, help="per DP rank")
    p.add_argument("--prompt", type=int, default=96)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--tokens-per-microbatch", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: this process's CPU seconds (robust to other load on a shared machine)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    from megarl.algorithms import policy_loss
    from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig
    from megarl.distributed.parallel import dims_from_env

    gpu = torch.cuda.is_available()
    hidden, inter, layers, heads, kv, vocab = PRESETS[args.preset]
    max_len = args.prompt * 3 // 2 + args.response
    dims = dims_from_env().initialize()
    model_dir = random_llama(args.preset, dims, max_positions=max_len, tag="packing")
    dtype = "bfloat16" if gpu else "float32"
    batch = ragged_batch(args.sequences, args.prompt, args.response, vocab, dims.dp_rank)

    def loss_fn(out, mb, totals):
        return policy_loss(out.logprobs, mb.fields["old_logprobs"], mb.fields["advantages"], mb.response_mask, global_tokens=totals.tokens)

    engines, fed = {}, {}
    for layout in ("packed", "padded"):
        cfg = EngineConfig(dtype=dtype, optim=OptimConfig(lr=1e-6), max_tokens_per_microbatch=args.tokens_per_microbatch,
                           sequence_packing=layout == "packed")
        engines[layout] = MegatronEngine(str(model_dir), dims, cfg)
        fed[layout] = sum(mb["input_ids"].numel() for mb in engines[layout]._micro_batches(batch, list(range(len(batch)))))

    def step(engine) -> float:
        if gpu:
            torch.cuda.synchronize()
        start = clock()
        batch.tensors["old_logprobs"] = engine.forward_only(batch).logprobs
        engine.train_step(batch, loss_fn, fields=("old_logprobs", "advantages"), num_global=args.sequences * dims.dp)
        if gpu:
            torch.cuda.synchronize()
        return clock() - start

    for engine in engines.values():
        step(engine)  # warm-up
    seconds = {layout: [] for layout in engines}
    for _ in range(args.rounds):
        for layout, engine in engines.items():
            seconds[layout].append(step(engine))
    median = {layout: statistics.median(s) for layout, s in seconds.items()}
    real = sum(len(s) for s in batch.input_ids)
    result = {
        "preset": args.preset, "dtype": dtype, "sequences_per_dp_rank": args.sequences, "world_size": dims.world_size,
        "tokens_per_microbatch": args.tokens_per_microbatch, "real_tokens_per_dp_rank": real,
        "tokens_fed_to_model": fed, "padding_fraction": {k: round(1 - real / v, 4) for k, v in fed.items()},
        "median_seconds_per_step": {k: round(v, 4) for k, v in median.items()},
        "real_tokens_per_second": {k: round(real * dims.dp / v, 1) for k, v in median.items()},
        "speedup_packed_over_padded": round(median["padded"] / median["packed"], 3),
        "rounds": args.rounds,
        "device": device_name(),
        "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
        "step": "forward_only (old log-probs) + one train_step (policy loss, Adam), as in a PPO actor update",
    }
    return finish(result, args.out, dims)


if __name__ == "__main__":
    raise SystemExit(main())
