"""Run under torchrun (4 ranks) by tests/models/test_lora_layouts.py: the LoRA actor under many
layouts in one process group lifetime (groups rebuilt per layout). For each (model, layout): two PPO
actor updates on tests/engine/engine_worker.py's fixed batches (the first moves B off zero, so the
second gives A a gradient), then the log-probs of a fixed batch with and without the adapters and
the merged export. rank 0 writes the results with torch.save to --out.

A layout is `key=value` pairs joined by commas (tp, pp, vpp, ep, etp); "dp" alone is pure data
parallelism, which equals one process (tests/engine)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_worker import global_batch, update  # noqa: E402

from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig  # noqa: E402
from megarl.models.lora import LoraOptions  # noqa: E402
from megarl.distributed.parallel import dims_from_env  # noqa: E402


def parse(text: str) -> dict:
    if text == "dp":
        return {}
    return {k: int(v) for k, v in (part.split("=") for part in text.split(","))}


def run(model: str, layout: dict) -> dict:
    dims = dims_from_env(**layout).initialize()
    cfg = EngineConfig(optim=OptimConfig(lr=1e-2, weight_decay=0.0), max_tokens_per_microbatch=24,
                       lora=LoraOptions(rank=4, alpha=8.0, seed=1))
    engine = MegatronEngine(model, dims, cfg)
    trainable = sum(p.numel() for m in engine.modules for p in m.parameters() if p.requires_grad)
    frozen_without_grad = all(not hasattr(p, "main_grad") for m in engine.modules for p in m.parameters()
                              if not getattr(p, "is_lora", False))
    norms = []
    for step in (0, 1):
        norms += update(engine, dims, step, critic=False).grad_norms
    batch = global_batch(2).select(list(range(dims.dp_rank, 8, dims.dp)))
    on = engine.forward_only(batch).logprobs
    off = engine.forward_only(batch, adapters=False).logprobs
    on_all, off_all = [None] * dims.world_size, [None] * dims.world_size
    dist.all_gather_object(on_all, (dims.dp_rank, on))
    dist.all_gather_object(off_all, (dims.dp_rank, off))
    merged = {n: t.clone() for n, t in engine.export_hf()}
    counts = torch.tensor([trainable], dtype=torch.float64)
    dist.all_reduce(counts)
    dims.destroy()
    return dict(grad_norms=norms, on=dict(on_all), off=dict(off_all), merged=merged,
                frozen_without_grad=frozen_without_grad, trainable_sum=float(counts))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--layouts", nargs="+", required=True, help="model-index:layout, e.g. 1:ep=2,etp=2")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    results = {}
    for item in args.layouts:
        index, text = item.split(":", 1)
        results[(int(index), text)] = run(args.models[int(index)], parse(text))
    if dist.get_rank() == 0:
        torch.save(results, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
