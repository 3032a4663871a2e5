"""Run under torchrun (2 ranks) by tests/models/test_moe_671b.py: the gradients of MLA's latent norms
(q_layernorm, kv_layernorm) at tp2 equal those at tp1 on every rank without any TP reduction, so
finalize_model_grads must not sum them (builder._mla_latent_norms_at_build leaves qk_layernorm off).
Under sequence parallelism the latents are scattered back to s/tp tokens before the norms, so each
rank's gradient is its tokens' share: the norms carry the `sequence_parallel` tag, and the sum over
TP that finalize_model_grads makes of tagged gradients (here by hand) equals tp1.
Writes {"max_rel_diff": ..., "sp_max_rel_diff": ..., "qk_layernorm": ..., "sp_tagged": ...} to --out from rank 0."""
from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist


def norm_grads(model_dir: str, tp: int, sp: bool = False) -> tuple[dict[str, torch.Tensor], bool, bool]:
    from megarl.models import load_model
    from megarl.parallel import dims_from_env

    dims = dims_from_env(tp=tp, sequence_parallel=sp).initialize()
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
    weights = torch.randn((12, 2, spec.hidden_size), generator=gen)  # [s, b, h], layer 0's output
    if sp:  # this rank's s/tp tokens of it
        weights = weights.chunk(tp)[dims.tp_rank]
    (outputs[0] * weights).sum().backward()
    params = {n: p for n, p in model.named_parameters()
              if n.startswith("decoder.layers.0.") and ("q_layernorm" in n or "kv_layernorm" in n)}
    grads = {n: p.grad.clone() for n, p in params.items()}
    tagged = all(getattr(p, "sequence_parallel", False) for p in params.values())
    if sp and tagged:  # finalize_model_grads' sum of sequence-parallel grads over TP
        for g in grads.values():
            dist.all_reduce(g, group=dims.tp_group)
    flag = model.config.qk_layernorm
    dims.destroy()
    return grads, flag, tagged


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    one, _, _ = norm_grads(args.model, 1)
    two, flag, _ = norm_grads(args.model, 2)
    two_sp, flag_sp, tagged = norm_grads(args.model, 2, sp=True)
    assert one.keys() == two.keys() == two_sp.keys() and one, sorted(one)
    worst = []
    for other in (two, two_sp):
        diff = max(((other[n] - one[n]).abs().max() / one[n].abs().max()).item() for n in one)
        w = torch.tensor(diff, dtype=torch.float64)
        dist.all_reduce(w, op=dist.ReduceOp.MAX)
        worst.append(w.item())
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(dict(max_rel_diff=worst[0], sp_max_rel_diff=worst[1], qk_layernorm=flag or flag_sp, sp_tagged=tagged,
                           norms=sorted(one)), f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
