"""What each supervised stage puts into a MegatronEngine: its sequences, its loss, its metrics.

Both stages reuse the PPO engine unchanged (every layout, packing, the token budget per micro-batch,
LoRA): a step is one `train_step` over the global batch (one optimizer step), and validation is
`forward_only`. The trainer (megarl.supervised.trainer) picks one of the two tasks when it is built.

Sequences are `megarl.engine.batch.SequenceBatch`es: a "response" is what the loss reads.
- SFT: prompt + response; the log-probs of the response tokens (prompt masked).
- Reward model: each side of a pair is its text's tokens plus one placeholder token, with the
  whole text as the "prompt" and a response of one token: the engine's value at that slot is the
  scalar head's output on the last real token, the score `reward.model_path` reads
  (megarl.rewards.model.RewardModel builds its batch the same way).
"""
from __future__ import annotations

from typing import Sequence

import torch

from megarl.engine.batch import SequenceBatch
from megarl.engine.engine import MegatronEngine
from megarl.step.global_batch import GlobalBatch, LocalStats
from megarl.supervised.data import PreferencePair, SftExample
from megarl.supervised.losses import bradley_terry, bradley_terry_score_grads, sft_loss_contribution


def _chunks(n: int, size: int, dp: int) -> list[range]:
    """Validation chunks of at most `size` rows, each a multiple of dp rows (the tail below dp is left out)."""
    usable = n - n % dp
    return [range(s, min(s + size, usable)) for s in range(0, usable, size)]


class SftTask:
    """Supervised fine-tuning: the policy's next-token loss on response tokens (metrics sft/*)."""

    kind, data_kind, role, value_head, prefix = "sft", "sft", "actor", False, "sft"
    trains_value_head_bias = True  # (it has none)

    def batch(self, examples: Sequence[SftExample], block: range) -> SequenceBatch:
        """This rank's block of the global batch `examples`; response_len is the global batch's longest response."""
        response_len = max(len(e.response_ids) for e in examples)
        rows = [examples[g] for g in block]
        mask = torch.zeros(len(rows), response_len)
        for i, e in enumerate(rows):
            mask[i, :len(e.response_ids)] = 1.0
        return SequenceBatch([list(e.prompt_ids + e.response_ids) for e in rows], [len(e.prompt_ids) for e in rows],
                             list(block), response_len, {"response_mask": mask})

    def train(self, engine: MegatronEngine, examples: Sequence[SftExample], block: range, global_batch: GlobalBatch) -> dict:
        def loss_fn(out, mb, totals):
            mask = mb.response_mask
            loss = sft_loss_contribution(out.logprobs, mask, totals.tokens)
            # the metric is this micro-batch's token mean: the engine weights it by its tokens
            return loss, {"loss": -(out.logprobs * mask).sum() / mask.sum().clamp_min(1)}

        batch = self.batch(examples, block)
        stats = engine.train_step(batch, loss_fn, fields=(), num_global=len(examples))
        tokens = global_batch.reduce(_sum("tokens", batch.response_mask))["tokens"]
        return {"sft/loss": stats.metrics["loss"], "sft/grad_norm": stats.grad_norms[-1], "sft/response_tokens": tokens,
                "sft/skipped_steps": float(stats.skipped_steps)}

    def evaluate(self, engine: MegatronEngine, examples: Sequence[SftExample], rows_per_chunk: int, dims) -> dict:
        """val/sft/loss: the token-mean NLL of the validation responses (every DP rank its block of each chunk)."""
        nll, tokens = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for chunk in _chunks(len(examples), rows_per_chunk, dims.dp):
            part = [examples[i] for i in chunk]
            per_rank = len(part) // dims.dp
            batch = self.batch(part, range(dims.dp_rank * per_rank, (dims.dp_rank + 1) * per_rank))
            logprobs = engine.forward_only(batch).logprobs
            nll -= (logprobs.double() * batch.response_mask).sum()
            tokens += batch.response_mask.sum()
        stats = LocalStats()
        stats.ratios["val/sft/loss"] = (nll, tokens)
        return GlobalBatch(dims).reduce(stats)


class RewardTask:
    """Reward-model training on preference pairs: Bradley-Terry on the scalar head (metrics rm/*)."""

    kind, data_kind, role, value_head, prefix = "reward_model", "preference", "critic", True, "rm"
    # A pair's loss reads r_c - r_r, where the bias cancels: kept fixed (EngineConfig.train_value_head_bias),
    # so that transformers' head without a bias scores the export as megarl does.
    trains_value_head_bias = False

    def __init__(self, pad_token_id: int):
        self.pad = pad_token_id

    def batch(self, pairs: Sequence[PreferencePair], block: range) -> SequenceBatch:
        """Pair g of the global batch is sequences 2g (chosen) and 2g+1 (rejected), on the rank that holds g."""
        seqs, index = [], []
        for g in block:
            seqs += [list(pairs[g].chosen_ids), list(pairs[g].rejected_ids)]
            index += [2 * g, 2 * g + 1]
        return SequenceBatch([s + [self.pad] for s in seqs], [len(s) for s in seqs], index, 1,
                             {"response_mask": torch.ones(len(seqs), 1)})

    def scores(self, engine: MegatronEngine, batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen and rejected scores [P] of this rank's pairs."""
        values = engine.forward_only(batch).values[:, 0].double()
        return values[0::2], values[1::2]

    def train(self, engine: MegatronEngine, pairs: Sequence[PreferencePair], block: range, global_batch: GlobalBatch) -> dict:
        batch = self.batch(pairs, block)
        chosen, rejected = self.scores(engine, batch)  # at this step's weights: the logged metrics and the loss's gradient
        grad_c, grad_r = bradley_terry_score_grads(chosen, rejected, len(pairs))
        batch.tensors["score_grad"] = torch.stack([grad_c, grad_r], 1).reshape(-1, 1).float()

        def loss_fn(out, mb, totals):
            # sum_i dL/dr_i * r_i: the Bradley-Terry loss's gradient (megarl.supervised.losses)
            return (out.values * mb.fields["score_grad"] * mb.response_mask).sum(), {}

        stats = engine.train_step(batch, loss_fn, fields=("score_grad",), num_global=2 * len(pairs))
        metrics = _pair_metrics(global_batch, "rm", chosen, rejected)
        return {**metrics, "rm/grad_norm": stats.grad_norms[-1], "rm/skipped_steps": float(stats.skipped_steps)}

    def evaluate(self, engine: MegatronEngine, pairs: Sequence[PreferencePair], rows_per_chunk: int, dims) -> dict:
        """val/rm/loss, val/rm/accuracy, val/rm/margin over the validation pairs."""
        chosen, rejected = [], []
        for chunk in _chunks(len(pairs), rows_per_chunk, dims.dp):
            part = [pairs[i] for i in chunk]
            per_rank = len(part) // dims.dp
            c, r = self.scores(engine, self.batch(part, range(dims.dp_rank * per_rank, (dims.dp_rank + 1) * per_rank)))
            chosen.append(c)
            rejected.append(r)
        return _pair_metrics(GlobalBatch(dims), "val/rm", torch.cat(chosen), torch.cat(rejected))


def _sum(name: str, x: torch.Tensor) -> LocalStats:
    stats = LocalStats()
    stats.sum(name, x)
    return stats


def _pair_metrics(global_batch: GlobalBatch, prefix: str, chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
    stats = LocalStats()
    for name, per_pair in bradley_terry(chosen, rejected).items():
        stats.mean(f"{prefix}/{name}", per_pair)
    return global_batch.reduce(stats)
