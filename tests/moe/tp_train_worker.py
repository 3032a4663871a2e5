"""Run under torchrun (2 ranks) by tests/moe/test_moe_tensor_parallel.py: why megarl refuses MoE
training at parallel.tp > 1 (megarl.layout.refuse_moe_tensor_parallel). A tiny MoE model,
one PPO actor update with lr 0 (tests/engine/engine_worker.py's fixed batch, float32), so every
layout's gradients are taken at the same weights, on the same last mini-batch:

  tp2 ep2 etp1   as built: Megatron-Core's MoELayer refuses to train (no sequence parallelism);
  dp2            the reference (grad norms);
  ep2            the layout megarl asks for instead (tp1, experts over ep);
  tp2 ep2 etp1   with that guard lifted (each MoE layer's own config says sequence_parallel).

ep2 and tp2 ep2 etp1 both hold experts 0 and 1 whole on rank 0 with no expert data parallelism,
so their gradients there are complete and comparable. Results (rank 0) to --out with
torch.save: the error, grad norms, and rank 0's gradients of the first MoE layer's experts.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_worker import update  # noqa: E402  (the fixed PPO batch and loss)

from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig  # noqa: E402
from megarl.parallel import dims_from_env  # noqa: E402


def engine_for(model: str, **layout):
    dims = dims_from_env(**layout).initialize()
    cfg = EngineConfig(optim=OptimConfig(lr=0.0, max_grad_norm=0.0, weight_decay=0.0), max_tokens_per_microbatch=24)
    return MegatronEngine(model, dims, cfg), dims


def lift_sequence_parallel_guard(engine) -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in engine.modules:
        for layer in module.modules():
            if isinstance(layer, MoELayer):
                layer.config = copy.copy(layer.config)  # the guard is its only reader of sequence_parallel
                layer.config.sequence_parallel = True


def first_moe_layer_grads(engine) -> dict[str, torch.Tensor]:
    return {name: p.main_grad.clone() for name, p in engine.modules[0].named_parameters()
            if "layers.0.mlp.experts.local_experts." in name}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = {}

    engine, dims = engine_for(args.model, tp=2, ep=2, etp=1)
    try:
        update(engine, dims, 0, critic=False)
        result["error"] = None
    except ValueError as e:
        result["error"] = str(e)
    dims.destroy()

    for name, layout, lift in (("dp2", dict(), False), ("ep2", dict(ep=2), False),
                               ("tp2_ep2_etp1", dict(tp=2, ep=2, etp=1), True)):
        engine, dims = engine_for(args.model, **layout)
        if lift:
            lift_sequence_parallel_guard(engine)
        stats = update(engine, dims, 0, critic=False)
        result[name] = dict(grad_norms=stats.grad_norms, grads=first_moe_layer_grads(engine))
        dims.destroy()
    if dist.get_rank() == 0:
        torch.save(result, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
