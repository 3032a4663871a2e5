"""Model TFLOP/s and MFU of a PPO actor update (Megatron engine, policy loss), one process group.

    torchrun --standalone --nproc_per_node 1 benchmarks/actor_mfu.py --preset 1b --out benchmarks/results/actor_mfu_h200.json
    python benchmarks/actor_mfu.py --preset tiny --out /tmp/mfu.json          # CPU smoke run

Builds a random Llama-style model of the preset's size with make_tiny_model (bf16 on GPU), runs
`--warmup` + `--iters` actor updates on random sequences through MegatronEngine.train_step, and
reports tokens/s, model FLOPs per token (megarl.capacity.train_flops_per_token: 6 x the matmul
weights, LM head included, input-embedding lookup and norms not, + causal attention; forward +
backward; recompute not counted), TFLOP/s and MFU against --peak-tflops (989 for H100/H200 bf16
dense). Megatron-LM reaches about 40-50% MFU on such GPUs for dense models.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from _common import PRESETS, device_name, finish, random_llama  # benchmarks/_common.py


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--sequences", type=int, default=16, help="sequences per update, per DP rank")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from megarl.algorithms import policy_loss
    from megarl.engine.batch import SequenceBatch
    from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig
    from megarl.distributed.parallel import dims_from_env

    gpu = torch.cuda.is_available()
    seq = args.seq_len if args.preset != "tiny" else min(args.seq_len, 64)
    vocab = PRESETS[args.preset][-1]
    dims = dims_from_env(tp=args.tp, pp=args.pp).initialize()
    model_dir = random_llama(args.preset, dims, max_positions=seq, tag="mfu")
    dtype = "bfloat16" if gpu else "float32"
    engine = MegatronEngine(str(model_dir), dims, EngineConfig(dtype=dtype, optim=OptimConfig(lr=1e-6),
                                                               max_tokens_per_microbatch=seq * 2, recompute=args.recompute))
    params = sum(p.numel() for p in engine.module.parameters())
    params_t = torch.tensor([params], dtype=torch.float64, device=engine.device)
    dist.all_reduce(params_t, group=dims.mp_group)
    params = int(params_t.item())  # the whole model: sum over TP/PP shards (replicated norms count once per TP rank)

    gen = torch.Generator().manual_seed(0)
    n, resp = args.sequences, seq // 2
    ids = torch.randint(0, min(vocab, 1000), (n, seq), generator=gen).tolist()
    batch = SequenceBatch(ids, [seq - resp] * n, [dims.dp_rank * n + i for i in range(n)], resp,
                          {"response_mask": torch.ones(n, resp), "advantages": torch.randn(n, resp, generator=gen)})
    batch.tensors["old_logprobs"] = engine.forward_only(batch).logprobs

    def loss_fn(out, mb, totals):
        return policy_loss(out.logprobs, mb.fields["old_logprobs"], mb.fields["advantages"], mb.response_mask, global_tokens=totals.tokens)

    def update():
        engine.train_step(batch, loss_fn, fields=("old_logprobs", "advantages"), num_global=n * dims.dp)

    for _ in range(args.warmup):
        update()
    if gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        update()
    if gpu:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.iters
    tokens = n * seq * dims.dp
    from megarl.capacity import arch_from_config, load_config, train_flops_per_token

    flops_per_token = train_flops_per_token(arch_from_config(load_config(model_dir)), seq)
    tflops_per_gpu = flops_per_token * tokens / seconds / dims.world_size / 1e12
    result = {
        "preset": args.preset, "params": params, "seq_len": seq, "sequences_per_dp_rank": n, "tp": args.tp, "pp": args.pp,
        "world_size": dims.world_size, "dtype": dtype, "recompute": args.recompute,
        "seconds_per_update": round(seconds, 4), "tokens_per_second": round(tokens / seconds, 1),
        "model_flops_per_token": flops_per_token,
        # significant digits, not decimals: a tiny model on a loaded CPU reads ~1e-4 TFLOP/s
        "model_tflops_per_gpu": float(f"{tflops_per_gpu:.4g}"), "mfu": float(f"{tflops_per_gpu / args.peak_tflops:.4g}") if gpu else None,
        "device": device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "note": "optimizer step and Megatron's distributed-optimizer all-gathers are included in the time",
    }
    return finish(result, args.out, dims)


if __name__ == "__main__":
    raise SystemExit(main())
