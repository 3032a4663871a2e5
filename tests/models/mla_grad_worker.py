"""Run under torchrun (2 ranks) by tests/models/test_moe_671b.py: the gradients of MLA's latent norms
(q_layernorm, kv_layernorm) at tp2 equal those at tp1 on every rank without any TP reduction, so
finalize_model_grads must not sum them (builder._mla_latent_norms_at_build leaves qk_layernorm off).
Writes {"max_rel_diff": ..., "qk_layernorm": ...} to --out from rank 0."""
from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist


def norm_grads(model_dir: str, tp: int) -> tuple[dict[str, torch.Tensor], bool]:
    from megarl.models import load_model
    from megarl.parallel import dims_from_env

    dims = dims_from_env(tp=tp).initialize()
    model, spec = load_model(model_dir, dims)
    model.eval()  # autograd still runs; training mode would ask for sequence parallelism with MoE x TP
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (2, 12), generator=gen)
    positions = torch.arange(12).unsqueeze(0).expand(2, -1)
    # The loss reads layer 0 only (MLA + dense MLP): MoE's backward under TP without sequence
    # parallelism, which Megatron refuses for training, stays out of the comparison.
    outputs = []
    model.decoder.layers[0].register_forward_hook(lambda module, args, out: outputs.append(out[0] if isinstance(out, tuple) else out))
    model(tokens, positions, None)
    weights = torch.randn(outputs[0].shape, generator=gen)
    (outputs[0] * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()
             if n.startswith("decoder.layers.0.") and ("q_layernorm" in n or "kv_layernorm" in n)}
    flag = model.config.qk_layernorm
    dims.destroy()
    return grads, flag


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    one, _ = norm_grads(args.model, 1)
    two, flag = norm_grads(args.model, 2)
    assert one.keys() == two.keys() and one, sorted(one)
    diff = max(((two[n] - one[n]).abs().max() / one[n].abs().max()).item() for n in one)
    worst = torch.tensor(diff, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(dict(max_rel_diff=worst.item(), qk_layernorm=flag, norms=sorted(one)), f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
