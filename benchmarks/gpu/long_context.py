"""Context parallelism on GPUs, bf16: Transformer-Engine's CP attention against megarl's CP attention
against cp1, on the same packed data layout (megarl.engine.context_parallel).

    torchrun --standalone --nproc_per_node 2 benchmarks/gpu/long_context.py --out "$OUT"   # 2+ GPUs
    torchrun --standalone --nproc_per_node 2 benchmarks/gpu/long_context.py --dry-run --out /tmp/lc  # CPU, gloo, toy

For each sequence length: a random ~1B Llama (benchmarks/_common.py's "1b" preset; "tiny" in the
dry run), one packed sequence per micro-batch, and three sides run in one process group lifetime:
  cp1        every rank trains its own sequence (the reference);
  megarl_cp  parallel.cp = world size, megarl's all-gather-K/V CP attention (the TE spec is turned
             off for this side, so the comparison holds on an image that has TE);
  te_cp      parallel.cp = world size with Transformer-Engine's TEDotProductAttention (p2p ring CP on
             THD input, `cu_seqlens_q_padded` = megarl's padded boundaries). Only where TE imports:
             UNTESTED so far (no GPU with TE has been lent); listed under not_measured otherwise.
Reported per side: forward-only log-probs max / mean |delta| against cp1 (bf16), the median seconds
of one actor update (`train_step`), and the peak device memory of that update.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def side(model_dir: str, cp: int, use_te: bool, L: int, dtype: str, rounds: int, vocab: int) -> dict:
    from megarl.algorithms import policy_loss
    from megarl.engine.batch import SequenceBatch
    from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig
    from megarl.models import builder
    from megarl.distributed.parallel import dims_from_env

    builder_te = builder.uses_transformer_engine
    if not use_te:  # megarl's SDPA/CP core attention even where TE is installed
        builder.uses_transformer_engine = lambda: False
    try:
        dims = dims_from_env(cp=cp).initialize()
        engine = MegatronEngine(model_dir, dims, EngineConfig(dtype=dtype, optim=OptimConfig(lr=1e-6), max_tokens_per_microbatch=L))
    finally:
        builder.uses_transformer_engine = builder_te
    R = L // 2
    g = torch.Generator().manual_seed(L)
    world = dims.world_size
    seqs = [torch.randint(0, vocab, (L,), generator=g).tolist() for _ in range(world)]
    # the same sequences everywhere: cp1 ranks take one each, a CP group takes them all in turn
    rows = [dims.dp_rank] if cp == 1 else list(range(world))
    tensors = {"response_mask": torch.ones(len(rows), R), "advantages": torch.randn(world, R, generator=g)[rows],
               "old_logprobs": torch.full((len(rows), R), -8.0)}
    batch = SequenceBatch([seqs[i] for i in rows], [L - R] * len(rows), rows, R, tensors)
    logprobs = engine.forward_only(batch).logprobs
    gathered = [None] * world
    dist.all_gather_object(gathered, {i: logprobs[k] for k, i in enumerate(rows)})
    all_lp = {i: v for part in gathered for i, v in part.items()}

    def loss_fn(o, mb, totals):
        return policy_loss(o.logprobs, mb.fields["old_logprobs"], mb.fields["advantages"], mb.response_mask, global_tokens=totals.tokens)

    times, peak = [], 0
    for r in range(rounds + 1):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        start = time.perf_counter()
        engine.train_step(batch, loss_fn, fields=("old_logprobs", "advantages"), num_global=len(rows) * dims.dp)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated())
        if r:  # the first is a warm-up
            # per sequence: a CP group trains `world` sequences where a cp1 rank trains one
            times.append((time.perf_counter() - start) / len(rows))
    dims.destroy()
    return {"logprobs": all_lp, "seconds_per_sequence": statistics.median(times), "peak_memory_gib": peak / 2**30}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=(8192, 16384, 32768))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, float32, the tiny preset, short sequences")
    p.add_argument("--out", required=True, help="directory for long_context_gpu.json")
    args = p.parse_args()

    from _common import PRESETS, device_name, finish, random_llama

    from megarl.models.builder import have_transformer_engine
    from megarl.distributed.parallel import dims_from_env

    preset, dtype = ("tiny", "float32") if args.dry_run else ("1b", "bfloat16")
    seq_lens = [64, 128] if args.dry_run else list(args.seq_lens)
    dims = dims_from_env().initialize()
    world = dims.world_size
    model_dir = str(random_llama(preset, dims, max(seq_lens), "long_context_gpu"))
    dims.destroy()
    sides = {"megarl_cp": False}
    not_measured = {}
    if have_transformer_engine() and torch.cuda.is_available():
        sides["te_cp"] = True
    else:
        not_measured["te_cp"] = "Transformer-Engine is not importable here (or no GPU)"
    vocab = PRESETS[preset][5]
    result = {}
    for L in seq_lens:
        ref = side(model_dir, 1, have_transformer_engine() and torch.cuda.is_available(), L, dtype, args.rounds, vocab)
        row = {"cp1": {k: ref[k] for k in ("seconds_per_sequence", "peak_memory_gib")}}
        for name, use_te in sides.items():
            got = side(model_dir, world, use_te, L, dtype, args.rounds, vocab)
            diff = torch.cat([(got["logprobs"][i] - ref["logprobs"][i]).abs().flatten() for i in ref["logprobs"]])
            row[name] = {"logprob_max_abs_diff_vs_cp1": diff.max().item(), "logprob_mean_abs_diff_vs_cp1": diff.mean().item(),
                         "seconds_per_sequence": got["seconds_per_sequence"], "peak_memory_gib": got["peak_memory_gib"],
                         "time_ratio_vs_cp1": round(got["seconds_per_sequence"] / ref["seconds_per_sequence"], 3)}
        result[str(L)] = row
    out = {"by_sequence_length": result, "not_measured": not_measured, "world_size": world, "preset": preset, "dtype": dtype,
           "command": "torchrun --standalone --nproc_per_node N benchmarks/gpu/long_context.py " + " ".join(sys.argv[1:]),
           "device": device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    dims = dims_from_env().initialize()
    return finish(out, str(Path(args.out) / "long_context_gpu.json"), dims)


if __name__ == "__main__":
    raise SystemExit(main())
