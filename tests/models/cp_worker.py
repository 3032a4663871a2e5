"""Run under torchrun by tests/models/test_context_parallel.py: context parallelism in one process
group lifetime (groups rebuilt per layout). With 2 ranks:

  logprobs  for every model of --models: forward-only log-probs and entropy of a packed batch at cp2
            (sequences of odd lengths, several per micro-batch, a filler row), against transformers'
            computed here (float32);
  update    one critic and one actor update (tests/engine/engine_worker.py's fixed batch and losses)
            at cp2 and at dp2 (= one process, tests/engine): grad norms, metrics, exported weights;
  grads     one actor update of each of --grad-models (a MoE and an MLA family) at cp2 and at dp2.
  ckpt      the cp2 actor's distributed checkpoint after that update, loaded by the dp2 actor
            (exported weights bit-equal to the saved ones), then a second update on each side
            (the cp2 one continuing), which must agree.
  cli       `megarl.tools.logprobs --cp 2` on --models[0] (it ends the process group), with --cli-dir.
With 4 ranks (tp2 with sequence parallelism, megarl's default at tp > 1): `logprobs` at cp2 x dp2
and at cp2 x tp2; `update`, `grads` and `ckpt` at cp2 x tp2 against dp4 (= one process, tests/engine);
`replay` (--replay-models ROLLOUT ACTOR, tests/moe/replay_cases.py) routing replay at cp2 x tp2,
where each TP rank replays the routes of its SP block of its CP share of the tokens; `cli` with --tp 2.

Results (rank 0) to --out with torch.save.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_worker import update  # noqa: E402  (the fixed PPO batch and losses)

from megarl.engine.batch import SequenceBatch  # noqa: E402
from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig  # noqa: E402
from megarl.distributed.parallel import dims_from_env  # noqa: E402

LENGTHS = (7, 12, 3, 9, 16, 5)
R = 4


def hf_reference(model_dir: str, sequences: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lps, ents = [], []
    with torch.no_grad():
        for seq in sequences:
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
            lps.append(logp[:-1].gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1))
            ents.append(-(logp.exp() * logp).sum(-1)[:-1])
    return lps, ents


def scoring_batch() -> SequenceBatch:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 301, (n,), generator=g).tolist() for n in LENGTHS]
    plens = [n - R if n > R + 1 else 1 for n in LENGTHS]
    mask = torch.zeros(len(seqs), R)
    for i, (n, p) in enumerate(zip(LENGTHS, plens)):
        mask[i, : n - p] = 1
    return SequenceBatch(seqs, plens, list(range(len(seqs))), R, {"response_mask": mask})


def logprob_diffs(model_dir: str, layout: dict, budget: int) -> dict:
    batch = scoring_batch()
    lps, ents = hf_reference(model_dir, batch.input_ids)
    dims = dims_from_env(**layout).initialize()
    engine = MegatronEngine(model_dir, dims, EngineConfig(max_tokens_per_microbatch=budget), trainable=False)
    out = engine.forward_only(batch, entropy=True)
    lp_diff = ent_diff = 0.0
    for i, (seq, p) in enumerate(zip(batch.input_ids, batch.prompt_lens)):
        n = len(seq) - p
        lp_diff = max(lp_diff, (out.logprobs[i, :n] - lps[i][p - 1:]).abs().max().item())
        ent_diff = max(ent_diff, (out.entropy[i, :n] - ents[i][p - 1:]).abs().max().item())
    dims.destroy()
    return {"logprobs": lp_diff, "entropy": ent_diff}


def weights(engine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.export_hf()}


def updates(model: str, layout: dict, ckpt: str, save: bool) -> dict:
    """The critic's update, then the actor's; the actor then saves (save) or loads (not save) the
    checkpoint `ckpt` and makes a second update."""
    out = {}
    for role in ("critic", "actor"):
        dims = dims_from_env(**layout).initialize()
        # Adam's eps = 1: the update is ~lr * g, smooth in the gradient, so the weights compare the
        # gradients (with eps 1e-8 an entry whose gradient is ~0 moves by +-lr on rounding noise)
        cfg = EngineConfig(optim=OptimConfig(lr=1e-3, max_grad_norm=0.0, weight_decay=0.0, eps=1.0), max_tokens_per_microbatch=24)
        engine = MegatronEngine(model, dims, cfg, value_head=role == "critic")
        stats = update(engine, dims, 0, critic=role == "critic")
        out[role] = dict(grad_norms=stats.grad_norms, metrics=stats.metrics, weights=weights(engine))
        if role == "actor":
            if save:
                engine.save(ckpt)
            else:
                engine.load(ckpt)
                out["loaded"] = weights(engine)
            second = update(engine, dims, 1, critic=False)
            out["second"] = dict(grad_norms=second.grad_norms, weights=weights(engine))
        dims.destroy()
    return out


def actor_update(model: str, layout: dict) -> dict:
    """One actor update at `layout` (the `updates` settings, no checkpoint): grad norms and weights."""
    dims = dims_from_env(**layout).initialize()
    cfg = EngineConfig(optim=OptimConfig(lr=1e-3, max_grad_norm=0.0, weight_decay=0.0, eps=1.0), max_tokens_per_microbatch=24)
    engine = MegatronEngine(model, dims, cfg)
    stats = update(engine, dims, 0, critic=False)
    out = dict(grad_norms=stats.grad_norms, weights=weights(engine))
    dims.destroy()
    return out


def replay(rollout_model: str, actor_model: str, layout: dict) -> dict:
    """Routing replay at `layout`: old log-probs (gathered over DP, global row order), the grad norm
    of one update and the largest replayed-vs-old log-prob gap in it (replay_cases.forward_and_update)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "moe"))
    from replay_cases import batch_of, forward_and_update, recorded_results

    from megarl.models.moe_routing import RouterOptions

    requests, results = recorded_results(Path(rollout_model))
    dims = dims_from_env(**layout).initialize()
    cfg = EngineConfig(dtype="float32", routing=RouterOptions(replay=True), optim=OptimConfig(lr=1e-2, weight_decay=0.0, max_grad_norm=0.0))
    engine = MegatronEngine(actor_model, dims, cfg)
    logprobs, grad_norm, gap = forward_and_update(engine, batch_of(requests, results, dims.dp_rank, dims.dp), num_global=len(results))
    parts: list = [None] * dims.world_size
    dist.all_gather_object(parts, (dims.dp_rank, logprobs, gap))
    full = torch.zeros(len(results), logprobs.shape[1])
    for dp_rank, lp, _ in parts:
        full[dp_rank::dims.dp] = lp
    dims.destroy()
    return {"logprobs": full, "grad_norm": grad_norm, "gap": max(g for _, _, g in parts)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--train-model", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cli-dir", help="run megarl.tools.logprobs --cp 2 on CLI_DIR/in.jsonl into CLI_DIR/out.jsonl")
    p.add_argument("--grad-models", nargs="*", default=(), help="one actor update each at the CP layout and at dp")
    p.add_argument("--replay-models", nargs=2, metavar=("ROLLOUT", "ACTOR"), help="routing replay at the CP layout")
    args = p.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    tp = 2 if world == 4 else 1
    cp_layout, ref_layout = dict(cp=2, tp=tp, sequence_parallel=tp > 1), dict()
    logprob_layouts = {"cp2": dict(cp=2)} | ({"cp2xtp2": cp_layout} if tp > 1 else {})
    result = {"logprobs": {name: {} for name in logprob_layouts}}
    for model in args.models:
        for name, layout in logprob_layouts.items():
            # budget 24: several sequences per micro-batch (padded to 4 each), a filler row
            result["logprobs"][name][Path(model).name] = logprob_diffs(model, layout, 24)
    # checkpoint written at cp2 (x tp2) after the first update, loaded at dp2 (dp4 with 4 ranks)
    result["cp"] = updates(args.train_model, cp_layout, args.ckpt, save=True)
    result["ref"] = updates(args.train_model, ref_layout, args.ckpt, save=False)
    # the same actor update for more families (MoE, MLA) at the CP layout and at dp (= one process)
    result["grads"] = {Path(m).name: {"cp": actor_update(m, cp_layout), "ref": actor_update(m, ref_layout)} for m in args.grad_models}
    if args.replay_models:
        result["replay"] = replay(*args.replay_models, cp_layout)
    if dist.get_rank() == 0:
        torch.save(result, args.out)
    dist.barrier()
    if args.cli_dir:
        from megarl.tools.logprobs import main as logprobs_main

        cli = Path(args.cli_dir)
        raise SystemExit(logprobs_main(["--model", args.models[0], "--cp", "2", "--tp", str(tp), "--input", str(cli / "in.jsonl"),
                                        "--output", str(cli / "out.jsonl")]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
