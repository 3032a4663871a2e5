"""Run under torchrun (2 ranks) by tests/layouts/test_engine_layouts.py: the engine's chunk handling
under virtual pipeline stages, in one process group lifetime (groups rebuilt per layout):

  pp2        one PPO actor update (tests/engine/engine_worker.py's fixed batch): the reference;
  pp2 vpp2   the same update (grad norms, metrics, exported weights), an offload round trip of
             every chunk's params / grads / optimizer state, then a distributed checkpoint;
  pp2 uneven and dp2: that checkpoint loaded (exported weights equal the saved engine's), then a
             second update each, which must agree with each other (optimizer state resharded too).

Results (rank 0) to --out with torch.save.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_worker import update  # noqa: E402  (the fixed PPO batch and loss)

from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig  # noqa: E402
from megarl.distributed.parallel import dims_from_env  # noqa: E402


def engine_for(model: str, **layout) -> tuple[MegatronEngine, object]:
    dims = dims_from_env(**layout).initialize()
    cfg = EngineConfig(optim=OptimConfig(lr=1e-3, max_grad_norm=0.0, weight_decay=0.0), max_tokens_per_microbatch=24,
                       param_offload=True, grad_offload=True, optimizer_offload=True)
    return MegatronEngine(model, dims, cfg), dims


def weights(engine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.export_hf()}


def state(engine) -> list[torch.Tensor]:
    """Every chunk's parameters, gradient buffers and optimizer state, in a fixed order."""
    out = [p.detach().clone() for m in engine.modules for p in m.parameters()]
    out += [b.grad_data.clone() for chunk in engine.chunks for b in chunk.buffers]
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        out += [v.clone() for s in opt.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = {}

    engine, dims = engine_for(args.model, pp=2)
    stats = update(engine, dims, 0, critic=False)
    result["pp2"] = dict(grad_norms=stats.grad_norms, metrics=stats.metrics, weights=weights(engine))
    dims.destroy()

    engine, dims = engine_for(args.model, pp=2, vpp=2)
    assert len(engine.chunks) == 2
    stats = update(engine, dims, 0, critic=False)
    before = state(engine)
    moved = engine.offload()
    assert set(moved) == {"params", "grads", "optimizer"} and all(v > 0 for v in moved.values()), moved
    engine.onload()
    after = state(engine)
    result["vpp_offload_bit_identical"] = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    result["vpp_offload_bytes"] = moved
    result["vpp"] = dict(grad_norms=stats.grad_norms, metrics=stats.metrics, weights=weights(engine))
    engine.save(args.ckpt)
    dims.destroy()

    for name, layout in (("uneven", dict(pp=2, first_stage_layers=1)), ("dp2", dict())):
        engine, dims = engine_for(args.model, **layout)
        engine.load(args.ckpt)
        loaded = weights(engine)
        stats = update(engine, dims, 1, critic=False)
        result[f"resumed_{name}"] = dict(loaded=loaded, grad_norms=stats.grad_norms, weights=weights(engine))
        dims.destroy()
    if dist.get_rank() == 0:
        torch.save(result, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
