"""Run under torchrun by tests/engine/test_engine.py. Modes:

  update   one PPO actor update (or critic update with --critic) on fixed data; rank 0 saves the
           exported HF weights, grad norms and metrics to --out.
  both     an actor update and a critic update, saved to --out as {"actor": ..., "critic": ...}.
  save     the update, then a distributed checkpoint to --ckpt.
  resume   load --ckpt (saved under any layout), then a second update; exports to --out.
  twice    two updates straight (the uninterrupted reference for resume); exports to --out.
  offload  offload params/grads/optimizer and back; asserts bit-identical state.
  clip     one step on the whole batch with clipping: reports Megatron's grad norm, the norm
           recomputed after clipping, and (rank 0) the norm transformers' autograd gives.
  banned   rollout.banned_token_ids (`BANNED`): forward-only log-probs and entropy of the whole
           batch with and without the ban, then the actor update with it.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from megarl.algorithms import policy_loss, value_loss
from megarl.engine.batch import SequenceBatch
from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig
from megarl.models.lora import LoraOptions
from megarl.distributed.parallel import dims_from_env

N, R = 8, 5  # sequences, response tokens


def global_batch(step: int) -> SequenceBatch:
    g = torch.Generator().manual_seed(100 + step)
    seqs, plens = [], []
    for _ in range(N):
        prompt = int(torch.randint(2, 6, (1,), generator=g))
        seqs.append(torch.randint(0, 300, (prompt + R,), generator=g).tolist())
        plens.append(prompt)
    mask = torch.ones(N, R)
    mask[0, 3:] = 0  # a short response
    mask[3, 1:3] = 0  # a hole inside a response (multi-turn)
    tensors = {
        "response_mask": mask,
        "advantages": torch.randn(N, R, generator=g),
        "returns": torch.rand(N, R, generator=g),
    }
    return SequenceBatch(seqs, plens, list(range(N)), R, tensors)


def banned_ids() -> tuple[int, ...]:
    """Every other token id of the 301-token vocabulary (both TP shards, the last real id 300) that
    no response of global_batch(0) holds: about half the mass of a random model is banned, and no
    trained token is."""
    full = global_batch(0)
    targets = {t for seq, plen in zip(full.input_ids, full.prompt_lens) for t in seq[plen:]}
    return tuple(t for t in range(0, 301, 2) if t not in targets)


def update(engine: MegatronEngine, dims, step: int, critic: bool, banned_token_ids: tuple[int, ...] = ()):
    full = global_batch(step)
    batch = full.select(list(range(dims.dp_rank, N, dims.dp)))  # this DP rank's share
    if critic:
        batch.tensors["old_values"] = engine.forward_only(batch).values

        def loss_fn(out, mb, totals):
            return value_loss(out.values, mb.fields["old_values"], mb.fields["returns"], mb.response_mask, 0.2,
                              global_tokens=totals.tokens)
        fields = ("old_values", "returns")
    else:
        batch.tensors["old_logprobs"] = engine.forward_only(batch, banned_token_ids=banned_token_ids).logprobs

        def loss_fn(out, mb, totals):
            return policy_loss(out.logprobs, mb.fields["old_logprobs"], mb.fields["advantages"], mb.response_mask,
                               global_tokens=totals.tokens)
        fields = ("old_logprobs", "advantages")
    return engine.train_step(batch, loss_fn, fields=fields, epochs=1, mini_batches=2, num_global=N, shuffle_seed=step,
                             banned_token_ids=banned_token_ids)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--mode", default="update")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--critic", action="store_true")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-grad-norm", type=float, default=0.0)
    p.add_argument("--packing", choices=("on", "off"), default="on")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (at tp > 1)")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int)
    p.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: every weight)")
    p.add_argument("--ckpt")
    p.add_argument("--out")
    args = p.parse_args()

    dims = dims_from_env(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, sequence_parallel=args.sp).initialize()
    if args.mode == "both":
        both = {role: run_role(args, dims, critic=(role == "critic"), mode="update") for role in ("actor", "critic")}
        if dist.get_rank() == 0:
            torch.save(both, args.out)
    else:
        result = run_role(args, dims, critic=args.critic, mode=args.mode)
        if dist.get_rank() == 0 and args.out:
            torch.save(result, args.out)
    dist.barrier()
    dist.destroy_process_group()


def run_role(args, dims, critic: bool, mode: str) -> dict:
    cfg = EngineConfig(optim=OptimConfig(lr=args.lr, max_grad_norm=args.max_grad_norm, weight_decay=0.0),
                       max_tokens_per_microbatch=24, sequence_packing=args.packing == "on", param_offload=True, grad_offload=True, optimizer_offload=True,
                       lora=LoraOptions(rank=args.lora_rank, alpha=8.0, seed=1) if args.lora_rank else None)
    engine = MegatronEngine(args.model, dims, cfg, value_head=critic)
    result = {"grad_norms": []}
    if mode == "resume":
        engine.load(args.ckpt)
    if mode == "banned":  # the whole batch on every DP rank: forward_only needs no split
        full = global_batch(0)
        # as plain dicts: the test reads the file with torch.load(weights_only=True)
        result["banned"] = vars(engine.forward_only(full, entropy=True, temperature=0.7, banned_token_ids=banned_ids()))
        result["free"] = vars(engine.forward_only(full, entropy=True, temperature=0.7))
    if mode != "clip":
        stats = update(engine, dims, 1 if mode == "resume" else 0, critic, banned_ids() if mode == "banned" else ())
        result["grad_norms"] += stats.grad_norms
        result["metrics"] = stats.metrics
    if mode == "twice":
        result["grad_norms"] += update(engine, dims, 1, critic).grad_norms
    if mode == "save":
        dist.barrier()
        engine.save(args.ckpt)
    if mode == "clip":
        result.update(clip_check(engine, dims, args.model))
    if mode == "offload":
        before = _snapshot(engine)
        moved = engine.offload()
        assert all(v > 0 for v in moved.values()) and set(moved) == {"params", "grads", "optimizer"}, moved
        assert all(t.untyped_storage().nbytes() == 0 for t in _param_storages(engine)), "params still resident"
        engine.onload()
        after = _snapshot(engine)
        assert before.keys() == after.keys()
        for k in before:
            assert torch.equal(before[k], after[k]), f"offload round trip changed {k}"
        result["moved_bytes"] = moved
    if critic:
        # The value head is not an HF weight: report it next to the backbone.
        head = engine.module.output_layer.weight.detach().clone() if dims.is_last_stage else None
        box = [head]
        dist.broadcast_object_list(box, src=dims.pp_stage_ranks()[-1], group=dims.pp_group)
        result["value_head"] = box[0]
    result["weights"] = {name: t.clone() for name, t in engine.export_hf()}
    return result


def clip_check(engine: MegatronEngine, dims, model_dir: str) -> dict:
    """Megatron's clipped step vs a single-process autograd norm of the same loss."""
    full = global_batch(0)
    batch = full.select(list(range(dims.dp_rank, N, dims.dp)))

    def loss_fn(out, mb, totals):
        loss = -(out.logprobs * mb.fields["advantages"] * mb.response_mask).sum() / totals.tokens
        return loss, {}

    stats = engine.train_step(batch, loss_fn, fields=("advantages",), num_global=N)
    after_clip = float(engine.optimizer.get_grad_norm())  # main grads were clipped in place
    out = {"reported": stats.grad_norms[0], "after_clip": after_clip}
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        total = 0.0
        for i in range(N):
            ids = torch.tensor([full.input_ids[i]])
            p = full.prompt_lens[i]
            logp = torch.log_softmax(hf(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            resp = logp[p - 1 : p - 1 + R]
            total = total - (resp * full.tensors["advantages"][i] * full.response_mask[i]).sum()
        (total / full.response_mask.sum()).backward()
        out["autograd"] = float(torch.sqrt(sum((q.grad.double() ** 2).sum() for q in hf.parameters() if q.grad is not None)))
    return out


def _param_storages(engine):
    return [b.param_data for b in engine.model.buffers]


def _snapshot(engine) -> dict[str, torch.Tensor]:
    snap = {f"param/{n}": p.detach().clone() for n, p in engine.module.named_parameters()}
    for i, b in enumerate(engine.model.buffers):
        snap[f"grad/{i}"] = b.grad_data.clone()
    for opt_i, opt in enumerate(getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])):
        for j, state in enumerate(opt.optimizer.state.values()):
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    snap[f"opt/{opt_i}/{j}/{k}"] = v.clone()
    return snap


if __name__ == "__main__":
    main()
