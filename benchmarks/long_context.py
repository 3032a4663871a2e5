"""Long sequences under context parallelism: per rank, the bytes of activations saved for backward
(all, and the share saved inside the norms) and the step time of one actor micro-batch, at cp1, cp2
and tp2 without and with sequence parallelism, as ratios to cp1 measured in one run, and tp2 with
SP over tp2 without (sequence parallelism splits the norms' activations over TP).

    torchrun --standalone --nproc_per_node 2 benchmarks/long_context.py \
        --out benchmarks/results/long_context_cpu.json

One torchrun of 2 ranks; the process groups are rebuilt per layout. Each micro-batch is one packed
sequence of L tokens (L in --seq-lens) through megarl's actor update (`MegatronEngine.train_step`,
PPO clip loss over its second half, the "response"): at cp1 each rank trains its own sequence
(2 data-parallel ranks), at cp2 and tp2 the two ranks train one sequence together.

Saved activations are counted deterministically with `torch.autograd.graph.saved_tensors_hooks`:
every tensor autograd packs for backward during the forward passes of the step, deduplicated by
storage, parameters excluded (they are not activations); that is the memory one micro-batch's forward leaves for its
backward. megarl's CP attention saves only the local q/k/v (it re-gathers K/V in backward), so
cp2 holds about half of cp1's. Times are the median wall seconds of --rounds steps after one
warm-up; on a shared CPU they are only indicative, the byte counts are exact.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def saved_bytes_counter(params, modules=()):
    """(hooks context, result dict): bytes of distinct non-parameter storages packed for backward,
    in all ("bytes") and the share packed inside a norm module ("norm_bytes": the activations
    sequence parallelism splits over TP; dropout would be the other share, but megarl builds its
    models with hidden and attention dropout 0, so no dropout mask is saved at all)."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    seen: set[int] = set()
    out = {"bytes": 0, "norm_bytes": 0}
    inside_norm = [0]
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
                sub.register_forward_pre_hook(lambda *_: inside_norm.__setitem__(0, inside_norm[0] + 1))
                sub.register_forward_hook(lambda *_: inside_norm.__setitem__(0, inside_norm[0] - 1))

    def pack(t):
        if torch._C._current_graph_task_id() != -1:
            # packed inside backward (megarl's CP attention recomputing one layer): freed at once, not held
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in seen and ptr not in param_storages and ptr != 0:
            seen.add(ptr)
            out["bytes"] += storage.nbytes()
            if inside_norm[0]:
                out["norm_bytes"] += storage.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), out


def one_layout(model_dir: str, layout: dict, seq_lens: list[int], rounds: int) -> dict:
    from megarl.algorithms import policy_loss
    from megarl.engine.batch import SequenceBatch
    from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig
    from megarl.distributed.parallel import dims_from_env

    dims = dims_from_env(**layout).initialize()
    out = {}
    for L in seq_lens:
        engine = MegatronEngine(model_dir, dims, EngineConfig(optim=OptimConfig(lr=1e-5), max_tokens_per_microbatch=L))
        R = L // 2
        g = torch.Generator().manual_seed(L)
        n_global = dims.dp  # one sequence per data-parallel rank
        seqs = [torch.randint(0, 4096, (L,), generator=g).tolist() for _ in range(n_global)]
        mine = [dims.dp_rank]
        tensors = {"response_mask": torch.ones(1, R), "advantages": torch.randn(1, R, generator=g),
                   "old_logprobs": torch.full((1, R), -8.0)}
        batch = SequenceBatch([seqs[i] for i in mine], [L - R], mine, R, tensors)

        def loss_fn(o, mb, totals):
            return policy_loss(o.logprobs, mb.fields["old_logprobs"], mb.fields["advantages"], mb.response_mask, global_tokens=totals.tokens)

        step = functools.partial(engine.train_step, batch, loss_fn, fields=("old_logprobs", "advantages"), num_global=n_global)

        hooks, counted = saved_bytes_counter([p for m in engine.modules for p in m.parameters()], engine.modules)
        with hooks:
            step()  # warm-up, and the count
        times = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        per_rank = [None] * dims.world_size
        dist.all_gather_object(per_rank, {"saved_activation_bytes": counted["bytes"], "saved_norm_bytes": counted["norm_bytes"],
                                          "step_seconds": statistics.median(times)})
        out[str(L)] = per_rank
        del engine
    dims.destroy()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=(1024, 2048, 4096, 8192))
    p.add_argument("--preset", default="small")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from _common import device_name, finish, random_llama

    from megarl.distributed.parallel import ParallelDims, dims_from_env

    dims = dims_from_env().initialize()
    model_dir = str(random_llama(args.preset, dims, max(args.seq_lens), "long_context"))
    dims.destroy()
    layouts = {"cp1": {}, "cp2": {"cp": 2}, "tp2": {"tp": 2}}
    not_measured = {}
    if "sequence_parallel" in {f.name for f in dataclasses.fields(ParallelDims)}:
        layouts["tp2_sp"] = {"tp": 2, "sequence_parallel": True}
    else:
        not_measured["tp2_sp"] = "this branch has no parallel.sequence_parallel"
    measured = {name: one_layout(model_dir, layout, list(args.seq_lens), args.rounds) for name, layout in layouts.items()}
    ratios = {}
    for L in map(str, args.seq_lens):
        base = measured["cp1"][L][0]
        ratios[L] = {name: {"saved_activations": round(max(r["saved_activation_bytes"] for r in m[L]) / base["saved_activation_bytes"], 4),
                            "saved_norm_activations": round(max(r["saved_norm_bytes"] for r in m[L]) / base["saved_norm_bytes"], 4),
                            "step_time": round(max(r["step_seconds"] for r in m[L]) / max(r["step_seconds"] for r in measured["cp1"][L]), 3)}
                     for name, m in measured.items() if name != "cp1"}
    # What sequence parallelism itself saves at tp2: its norm share (the dropout share is 0 bytes,
    # megarl's models have no dropout) and the whole, busiest rank with SP over busiest rank without.
    sp_vs_no_sp = {}
    if "tp2_sp" in measured:
        for L in map(str, args.seq_lens):
            sp, no_sp = measured["tp2_sp"][L], measured["tp2"][L]
            sp_vs_no_sp[L] = {key: round(max(r[field] for r in sp) / max(r[field] for r in no_sp), 4)
                              for key, field in (("saved_activations", "saved_activation_bytes"), ("saved_norm_activations", "saved_norm_bytes"))}
            sp_vs_no_sp[L]["norm_share_without_sp"] = round(no_sp[0]["saved_norm_bytes"] / no_sp[0]["saved_activation_bytes"], 4)
    result = {"ratios_to_cp1_busiest_rank": ratios, "tp2_sp_over_tp2_busiest_rank": sp_vs_no_sp, "per_rank": measured, "not_measured": not_measured,
              "model": {"preset": args.preset, "dtype": "float32"},
              "command": "torchrun --standalone --nproc_per_node 2 benchmarks/long_context.py " + " ".join(sys.argv[1:]),
              "device": device_name(), "threads": torch.get_num_threads(), "load_average_1_5_15": list(os.getloadavg()),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    dims = dims_from_env().initialize()
    return finish(result, args.out, dims)


if __name__ == "__main__":
    raise SystemExit(main())
