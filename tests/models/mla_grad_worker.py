"""Run under torchrun (2 ranks) by tests/models/test_moe_671b.py: the gradients of MLA's latent norms
(q_layernorm, kv_layernorm) at tp2 equal those at tp1 on every rank without any TP reduction, so
finalize_model_grads must not sum them (builder._mla_latent_norms_at_build leaves qk_layernorm off).
Under sequence parallelism the latents are scattered back to s/tp tokens before the norms, so each
rank's gradient is its tokens' share: the norms carry the `sequence_parallel` tag, and the sum over
TP that finalize_model_grads makes of tagged gradients (here by hand) equals tp1.
Then one actor train step (tests/engine/engine_worker.py's fixed batch, the PPO loss, one optimizer step)
at tp2 with sequence parallelism and at dp2 (= one process, tests/engine): grad norm and every
exported weight's change, the RoPE key rows of kv_a_proj_with_mqa on their own (the shared RoPE key's
gradient must be summed over TP: megarl.models.sequence_parallel.mla_sequence_sharded_kv).
Writes {"max_rel_diff": ..., "sp_max_rel_diff": ..., "qk_layernorm": ..., "sp_tagged": ..., "update": {...}}
to --out from rank 0."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_worker import global_batch  # noqa: E402  (the fixed PPO batch)


def norm_grads(model_dir: str, tp: int, sp: bool = False) -> tuple[dict[str, torch.Tensor], bool, bool]:
    from megarl.models import load_model
    from megarl.distributed.parallel import dims_from_env

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


def actor_update(model_dir: str, layout: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One optimizer step of the actor at `layout` on engine_worker's fixed batch (the PPO loss of the
    first step, ratio 1): its grad norm and each exported weight's change."""
    from megarl.algorithms import policy_loss
    from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig
    from megarl.distributed.parallel import dims_from_env

    dims = dims_from_env(**layout).initialize()
    # Adam's first step with eps = 1 moves each weight by lr * g / (|g| + 1), smooth in the gradient;
    # lr 1 makes the changes large against the float32 rounding of the weights they are read from.
    cfg = EngineConfig(optim=OptimConfig(lr=1.0, max_grad_norm=0.0, weight_decay=0.0, eps=1.0), max_tokens_per_microbatch=24)
    engine = MegatronEngine(model_dir, dims, cfg)
    before = {n: t.clone() for n, t in engine.export_hf()}
    full = global_batch(0)
    batch = full.select(list(range(dims.dp_rank, len(full.input_ids), dims.dp)))

    def loss_fn(out, mb, totals):
        return policy_loss(out.logprobs, out.logprobs.detach(), mb.fields["advantages"], mb.response_mask,
                           global_tokens=totals.tokens)

    stats = engine.train_step(batch, loss_fn, fields=("advantages",), mini_batches=1, num_global=len(full.input_ids))
    changes = {n: t - before[n] for n, t in engine.export_hf()}
    dims.destroy()
    return stats.grad_norms, changes


def update_diffs(model_dir: str) -> dict:
    """tp2 with sequence parallelism against one process (dp2): the largest relative difference of the
    grad norms, of any weight's change (relative to the largest change) and of kv_a_proj_with_mqa's
    RoPE key rows (relative to their own largest change)."""
    from megarl.models.families import load_spec

    sp_norms, sp = actor_update(model_dir, dict(tp=2, sequence_parallel=True))
    ref_norms, ref = actor_update(model_dir, {})
    rope = load_spec(model_dir).mla.qk_rope_head_dim
    scale = max(t.abs().max().item() for t in ref.values())
    kv_a = [n for n in ref if n.endswith("kv_a_proj_with_mqa.weight")]
    return dict(grad_norms=[sp_norms, ref_norms],
                grad_norm_rel=max(abs(a - b) / b for a, b in zip(sp_norms, ref_norms)),
                weights_rel=max((sp[n] - ref[n]).abs().max().item() for n in ref) / scale,
                rope_key_rel=max(((sp[n][-rope:] - ref[n][-rope:]).abs().max() / ref[n][-rope:].abs().max()).item() for n in kv_a),
                kv_a=len(kv_a))


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
    updated = update_diffs(args.model)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(dict(max_rel_diff=worst[0], sp_max_rel_diff=worst[1], qk_layernorm=flag or flag_sp, sp_tagged=tagged,
                           norms=sorted(one), update=updated), f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
