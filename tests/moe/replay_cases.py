"""Shared by test_moe_routing.py and replay_worker.py: a tiny MoE model, the same model with other
router weights (the actor after its routers moved on), and a batch of responses whose routes the
hf rollout engine recorded on the first."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

PROMPTS = [(5, 6, 7, 8), (9, 10), (11, 12, 13, 14, 15, 16), (17,)]  # different lengths: padding, packing
SAMPLES, RESPONSE_LEN = 2, 6


def make_models(root: Path) -> tuple[Path, Path]:
    """(rollout model A, actor model B): B is A with new random router weights (seeded)."""
    from safetensors.torch import load_file, save_file

    from megarl.tools.make_tiny_model import make_tiny_model

    a, b = root / "rollout", root / "moved"
    if not (a / "config.json").exists():
        make_tiny_model("qwen3_moe", a, vocab_size=301, seed=3)
    if not (b / "config.json").exists():
        shutil.copytree(a, b)
        weights = load_file(str(a / "model.safetensors"))
        g = torch.Generator().manual_seed(11)
        for name in sorted(weights):
            if name.endswith("mlp.gate.weight"):
                weights[name] = torch.randn(weights[name].shape, generator=g)
        save_file(weights, str(b / "model.safetensors"), metadata={"format": "pt"})
    return a, b


def recorded_results(model_dir: Path, dtype=torch.float32):
    """The hf engine's samples of PROMPTS (seeded), with their routes recorded."""
    from transformers import AutoModelForCausalLM

    from megarl.rollout.base import RolloutRequest, SamplingParams
    from megarl.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype), max_batch_rows=3)
    engine.record_routes = True
    requests = [RolloutRequest(p, i) for i, p in enumerate(PROMPTS)]
    results = engine.generate(requests, SamplingParams(n=SAMPLES, max_new_tokens=RESPONSE_LEN, seed=5, stop_token_ids=(2,)))
    return requests, results


def batch_of(requests, results, dp_rank: int = 0, dp: int = 1, routes: bool = True):
    """This DP rank's rows (every dp-th result) as a SequenceBatch with advantages for an update."""
    from megarl.engine.batch import SequenceBatch

    n = len(results)
    mask = torch.zeros(n, RESPONSE_LEN)
    for i, r in enumerate(results):
        mask[i, :len(r.response_token_ids)] = 1.0
    advantages = torch.randn(n, RESPONSE_LEN, generator=torch.Generator().manual_seed(7)) * mask
    full = SequenceBatch([list(requests[r.prompt_index].prompt_token_ids) + r.response_token_ids for r in results],
                         [len(requests[r.prompt_index].prompt_token_ids) for r in results], list(range(n)), RESPONSE_LEN,
                         {"response_mask": mask, "advantages": advantages},
                         [r.routed_experts for r in results] if routes else None)
    return full.select(list(range(dp_rank, n, dp)))


def forward_and_update(engine, batch, num_global: int, stats_out: list | None = None) -> tuple[torch.Tensor, float, float]:
    """Old log-probs of the batch, then one policy-gradient step on it: (log-probs, grad norm, the
    largest |update forward's log-prob - old log-prob| on a response token, before the step);
    stats_out: a list the step's TrainStats is appended to."""
    from megarl.algorithms import policy_loss

    batch.tensors["old_logprobs"] = engine.forward_only(batch).logprobs
    gap = [0.0]

    def loss_fn(out, mb, totals):
        mask = mb.response_mask
        gap[0] = max(gap[0], float(((out.logprobs - mb.fields["old_logprobs"]).abs() * mask).max()))
        return policy_loss(out.logprobs, mb.fields["old_logprobs"], mb.fields["advantages"], mask, global_tokens=totals.tokens)

    stats = engine.train_step(batch, loss_fn, fields=("old_logprobs", "advantages"), num_global=num_global)
    if stats_out is not None:
        stats_out.append(stats)
    return batch.tensors["old_logprobs"], stats.grad_norms[0], gap[0]
