"""Run under torchrun (2 ranks) by tests/moe/test_moe_tensor_parallel.py: MoE training at
parallel.tp > 1 with sequence parallelism against tp1. A tiny MoE model, one PPO actor update with
lr 0 (tests/engine/engine_worker.py's fixed batch, float32), so every layout's gradients are taken
at the same weights, on the same last mini-batch:

  tp2 ep2 etp1          without sequence parallelism, as built: Megatron-Core's MoELayer refuses to train;
  ep2                   tp1, experts over ep: the reference (megarl's MoE layout before sequence
                        parallelism; it matched plain dp2 to 1e-7 in the grad norms);
  tp2 ep2 etp1 + SP     sequence parallelism (megarl's default at tp > 1);
  tp2 ep2 etp1 lifted   without sequence parallelism, Megatron's guard lifted: why megarl refuses
                        parallel.sequence_parallel=false for MoE at tp > 1.

ep2 and both tp2 ep2 etp1 layouts hold experts 0 and 1 whole on rank 0 with no expert data
parallelism, so their expert gradients there are complete and comparable. The routers are dense
(replicated) parameters: at tp2 x ep2 (dp 1) their main_grad is complete after finalize_model_grads
(the sequence-parallel TP sum); at ep2 (dp 2) the distributed optimizer leaves each rank only its
shard reduced, so the worker takes the routers' local gradients just before finalize_model_grads and
sums them over DP itself. Results (rank 0) to --out with torch.save.
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
from megarl.distributed.parallel import dims_from_env  # noqa: E402

ROUTER = ".mlp.router.weight"


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


def snapshot_routers_before_finalize(engine) -> dict:
    """{name: local router gradient} of the last finalize_model_grads call (before any reduction)."""
    seen: dict = {}
    config = engine.module.config
    finalize = config.finalize_model_grads_func

    def wrapped(*args, **kwargs):
        for name, p in engine.modules[0].named_parameters():
            if name.endswith(ROUTER):
                seen[name] = p.main_grad.detach().clone()
        return finalize(*args, **kwargs)

    config.finalize_model_grads_func = wrapped
    return seen


def grads(engine, dims, router_before: dict | None) -> dict[str, torch.Tensor]:
    named = dict(engine.modules[0].named_parameters())
    out = {name: p.main_grad.clone() for name, p in named.items() if "layers.0.mlp.experts.local_experts." in name}
    for name, p in named.items():
        if name.endswith(ROUTER):
            g = p.main_grad.clone()
            if router_before is not None:  # sum of the DP ranks' raw gradients / dp (DDP's average of dp-scaled losses)
                g = router_before[name].clone()
                dist.all_reduce(g, group=dims.dp_group)
                g /= dims.dp
            out[name] = g
    return out


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

    for name, layout, lift in (("ep2", dict(ep=2), False),
                               ("tp2_ep2_etp1_sp", dict(tp=2, ep=2, etp=1, sequence_parallel=True), False),
                               ("tp2_ep2_etp1_lifted", dict(tp=2, ep=2, etp=1), True)):
        engine, dims = engine_for(args.model, **layout)
        if lift:
            lift_sequence_parallel_guard(engine)
        before = snapshot_routers_before_finalize(engine) if dims.dp > 1 else None
        stats = update(engine, dims, 0, critic=False)
        result[name] = dict(grad_norms=stats.grad_norms, grads=grads(engine, dims, before))
        dims.destroy()
    if dist.get_rank() == 0:
        torch.save(result, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
