"""Delta weight sync against full sync: bytes per sync and sync time, under real PPO updates.

    python benchmarks/delta_sync.py --out benchmarks/results/delta_sync_cpu.json

(re-launches itself under torchrun with 2 processes; on CPU with gloo, on 2 GPUs with NCCL: the
same script is the GPU measurement for the day two GPUs are lent). For each
model and learning rate: rank 0 trains a random-init Hugging Face model in fp32 (AdamW, betas
0.9 / 0.999, weight decay 0.01, gradient clipping 1.0) with PPO's clipped surrogate loss
(megarl.algorithms.losses.policy_loss) on random token sequences with random per-sequence
advantages; after every update the bf16 rollout copy of each weight goes to both ranks, which
hold it as a train tp2 model (2-D and 3-D weights split on dim 0) and sync it into rollout tp1,
once with a full-mode HybridEngine and once with a delta-mode one (order alternated per step),
checking the two streams are bitwise equal. The first sync of each run is full in both modes; the
`--steps` syncs after it are the ones compared.

Models (per-layer shapes of real ones, fewer layers: the changed fraction is a property of each
element's update against its bf16 spacing, the same in every layer of a shape):
  dense: TinyLlama-1.1B's shapes (hidden 2048, MLP 5632, 32 heads, 4 KV heads, vocab 32000), 1 layer
  moe:   a small-expert Qwen2-MoE (hidden 1024, 16 experts of 512, top 4, a shared expert of 2048), 1 layer

JSON: per model, per lr: bytes and seconds of every sync in both modes (max over ranks), the
changed fraction, and `bytes_over_full` / `seconds_over_full` (sums over the compared syncs);
top-level `bytes_over_full` maps lr -> the ratio over both models' bytes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.algorithms.losses import policy_loss
from megarl.hybrid import delta
from megarl.hybrid.engine import HybridEngine
from megarl.hybrid.layout import RolloutLayout, TrainLayout
from megarl.models.sharding import ShardMeta

TRAIN = TrainLayout(2, 1, 1, 1)
BREAK_EVEN = delta.TIME_BREAK_EVEN_FRACTION
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")  # NCCL there, else gloo


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="dense,moe")
    p.add_argument("--lrs", default="1e-6,1e-5")
    p.add_argument("--steps", type=int, default=10, help="PPO updates, each followed by a sync in both modes")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=48, help="tokens per sequence (the last 32 are the response)")
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--tiny", action="store_true", help="toy sizes (tests: the script runs end to end)")
    return p.parse_args(argv)


def build_model(kind: str, layers: int, tiny: bool):
    """A random-init transformers model (std 0.02) in fp32."""
    import transformers

    torch.manual_seed(0)
    if kind == "dense":
        hidden, inter, heads, kv, vocab = (64, 160, 4, 2, 512) if tiny else (2048, 5632, 32, 4, 32000)
        cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                                       num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=256, initializer_range=0.02)
        return transformers.LlamaForCausalLM(cfg)
    hidden, expert, experts, shared, heads, kv, vocab = (64, 32, 4, 64, 4, 2, 512) if tiny else (1024, 512, 16, 2048, 16, 4, 32000)
    cfg = transformers.Qwen2MoeConfig(hidden_size=hidden, intermediate_size=shared, moe_intermediate_size=expert, num_experts=experts,
                                      num_experts_per_tok=min(4, experts), shared_expert_intermediate_size=shared, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=256,
                                      initializer_range=0.02, decoder_sparse_step=1)
    return transformers.Qwen2MoeForCausalLM(cfg)


def ppo_update(model, opt, step: int, batch: int, seq: int, vocab: int) -> float:
    """One PPO update: clipped surrogate on random sequences with random per-sequence advantages."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(DEVICE)
    response = min(32, seq - 1)
    logits = model(input_ids=ids).logits[:, -response - 1:-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, -response:, None]).squeeze(-1)
    # old log-probs a little off the current ones, as after an earlier mini-batch of the step
    old = logp.detach() + 0.05 * torch.randn(logp.shape, generator=g).to(DEVICE)
    advantages = torch.randn(batch, 1, generator=g).expand(batch, response).to(DEVICE)
    loss, _ = policy_loss(logp, old, advantages, torch.ones(batch, response, device=DEVICE))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def shard_meta(shape) -> tuple[int | None, int]:
    """(tp_dim, tp_size): weights of 2+ dims split on dim 0 over the training tp, vectors replicated."""
    if len(shape) >= 2 and shape[0] % TRAIN.tp == 0:
        return 0, TRAIN.tp
    return None, 1


def rollout_weights(names_shapes, model, rank: int) -> dict[str, torch.Tensor]:
    """bf16 copies of every weight on both ranks (rank 0 trains; a broadcast per tensor)."""
    out = {}
    params = dict(model.named_parameters()) if model is not None else {}
    for name, shape in names_shapes:
        t = (params[name].detach().to(DEVICE, torch.bfloat16).contiguous() if rank == 0
             else torch.empty(shape, dtype=torch.bfloat16, device=DEVICE))
        dist.broadcast(t, src=0)
        out[name] = t
    return out


def local_shards(full: dict[str, torch.Tensor], rank: int):
    shards = {}
    for name, t in full.items():
        tp_dim, tp = shard_meta(t.shape)
        meta = ShardMeta(full_shape=tuple(t.shape), tp_dim=tp_dim, tp_rank=rank if tp_dim is not None else 0, tp_size=tp)
        shards[name] = (meta.slice_of_full(t).contiguous(), meta)
    return shards


MODES = ("full", "delta", "delta_bytes_rule")


def timed_stream(engine: HybridEngine, shards, mode: str) -> tuple[dict[str, torch.Tensor], float]:
    delta.TIME_BREAK_EVEN_FRACTION = float("inf") if mode == "delta_bytes_rule" else BREAK_EVEN
    dist.barrier()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    got = {name: t.clone() for name, t in engine.stream(shards)}
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return got, seconds


def max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run_one(kind: str, lr: float, args, rank: int) -> dict:
    model = opt = None
    if rank == 0:
        model = build_model(kind, args.layers, args.tiny).to(DEVICE)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    meta = [[(n, tuple(p.shape)) for n, p in model.named_parameters()] if rank == 0 else None]
    dist.broadcast_object_list(meta, src=0)
    names_shapes = meta[0]
    vocab = [model.config.vocab_size if rank == 0 else None]
    dist.broadcast_object_list(vocab, src=0)
    shards = local_shards(rollout_weights(names_shapes, model, rank), rank)
    bucket = int(args.bucket_mb * 2**20)
    # full_every past the run: only the first sync of the delta engine is full
    # "delta_bytes_rule": delta with the CPU time break-even off (the encoding chosen by bytes
    # alone, as before issue 42), timed interleaved with the other two in the same run
    engines = {mode: HybridEngine(shards, train=TRAIN, rollout=RolloutLayout(1), bucket_bytes=bucket,
                                  mode="full" if mode == "full" else "delta", full_every=args.steps + 2) for mode in MODES}
    for mode in MODES:  # the first sync: full in all
        timed_stream(engines[mode], shards, mode)
    rows = []
    for step in range(1, args.steps + 1):
        loss = ppo_update(model, opt, step, args.batch, args.seq, vocab[0]) if rank == 0 else 0.0
        shards = local_shards(rollout_weights(names_shapes, model, rank), rank)
        order = MODES[step % 3:] + MODES[:step % 3]  # each mode first, middle and last in turn
        got, seconds = {}, {}
        for mode in order:
            got[mode], seconds[mode] = timed_stream(engines[mode], shards, mode)
        for mode in MODES[1:]:
            for name, t in got["full"].items():
                if not torch.equal(t.view(torch.int16), got[mode][name].view(torch.int16)):
                    raise AssertionError(f"{kind} lr {lr} step {step}: {mode} {name} differs from the full sync's")
        d, f, b = engines["delta"].last_stats, engines["full"].last_stats, engines["delta_bytes_rule"].last_stats
        full_b, delta_b, full_s, delta_s, changed, rule_b, rule_s = max_over_ranks(
            [f.bytes_received, d.bytes_received, seconds["full"], seconds["delta"], d.changed_fraction,
             b.bytes_received, seconds["delta_bytes_rule"]])
        rows.append(dict(step=step, loss=loss, full_bytes=int(full_b), delta_bytes=int(delta_b), full_s=round(full_s, 4),
                         delta_s=round(delta_s, 4), changed_fraction=round(changed, 5),
                         bytes_rule_bytes=int(rule_b), bytes_rule_s=round(rule_s, 4)))
        if rank == 0:
            print(f"{kind} lr {lr:g} step {step}: changed {changed:.4f}, bytes {delta_b / full_b:.3f} of full "
                  f"(bytes rule {rule_b / full_b:.3f}), seconds {delta_s:.3f} (bytes rule {rule_s:.3f}) vs {full_s:.3f}", flush=True)
    total_full, total_delta = sum(r["full_bytes"] for r in rows), sum(r["delta_bytes"] for r in rows)
    copy_bytes = max_over_ranks([engines["delta"].delta_copy_bytes()])[0]
    return dict(steps=rows, full_bytes_per_sync=total_full / len(rows), delta_bytes_per_sync=total_delta / len(rows),
                bytes_over_full=round(total_delta / total_full, 4),
                seconds_over_full=round(sum(r["delta_s"] for r in rows) / sum(r["full_s"] for r in rows), 4),
                bytes_rule_bytes_over_full=round(sum(r["bytes_rule_bytes"] for r in rows) / total_full, 4),
                bytes_rule_seconds_over_full=round(sum(r["bytes_rule_s"] for r in rows) / sum(r["full_s"] for r in rows), 4),
                # spread of the per-sync time ratios (the machine is shared: one sync can be 2x off)
                seconds_over_full_per_sync=[round(r["delta_s"] / r["full_s"], 3) for r in rows],
                bytes_rule_seconds_over_full_per_sync=[round(r["bytes_rule_s"] / r["full_s"], 3) for r in rows],
                median_full_s=statistics.median(r["full_s"] for r in rows), median_delta_s=statistics.median(r["delta_s"] for r in rows),
                changed_fraction_mean=round(statistics.mean(r["changed_fraction"] for r in rows), 5),
                copy_bytes_per_rank=int(copy_bytes), model_bf16_bytes=sum(2 * torch.Size(s).numel() for _, s in names_shapes))


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:  # re-launch under torchrun: 2 processes, train tp2 -> rollout tp1
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, *sys.argv[1:]]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        sys.exit(subprocess.call(cmd, env=env))
    dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo")
    rank = dist.get_rank()
    if DEVICE.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    results: dict = {}
    lrs = [float(x) for x in args.lrs.split(",")]
    for kind in args.models.split(","):
        results[kind] = {f"{lr:g}": run_one(kind, lr, args, rank) for lr in lrs}
    if rank == 0:
        by_lr = {}
        for lr in lrs:
            key = f"{lr:g}"
            full = sum(results[k][key]["full_bytes_per_sync"] for k in results)
            sent = sum(results[k][key]["delta_bytes_per_sync"] for k in results)
            by_lr[key] = round(sent / full, 4)
        out = dict(benchmark="delta_sync", command=" ".join(["python", "benchmarks/delta_sync.py", *sys.argv[1:]]),
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), machine=platform.node(),
                   cpu=platform.processor() or platform.machine(), torch=torch.__version__, layout=f"train tp2 -> rollout tp1, {dist.get_backend()}",
                   rollout_dtype="bfloat16", master_dtype="float32", steps=args.steps, bytes_over_full=by_lr,
                   seconds_over_full={f"{lr:g}": round(sum(results[k][f'{lr:g}']['median_delta_s'] for k in results)
                                                       / sum(results[k][f'{lr:g}']['median_full_s'] for k in results), 4) for lr in lrs},
                   # the same medians for delta with the byte rule alone (no CPU time break-even)
                   bytes_rule_seconds_over_full={f"{lr:g}": round(sum(statistics.median(r["bytes_rule_s"] for r in results[k][f'{lr:g}']["steps"]) for k in results)
                                                                  / sum(results[k][f'{lr:g}']['median_full_s'] for k in results), 4) for lr in lrs},
                   models=results, note="wall seconds on a shared, loaded 2-core machine: noisy")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps({k: out[k] for k in ("bytes_over_full", "seconds_over_full", "bytes_rule_seconds_over_full")}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
