"""The unit of data the engines work on: this DP rank's sequences plus per-response-token fields.

Sequence i is `input_ids[i]` = prompt + response. Response token j of sequence i sits at position
`prompt_lens[i] + j`; the model output that predicts it (its log-prob, the value of the state
before it) sits at position `prompt_lens[i] + j - 1`. Per-token tensors are `[n, response_len]`
with `response_len` the same on every rank (the global max response length), left-aligned.

The engine's boundary is typed: `forward_only` returns `ModelOutputs`; a loss is called per
micro-batch as loss_fn(ModelOutputs, LossBatch, Totals) (`LossFn`). What the per-token fields mean is
the caller's (megarl.step.step_record names the PPO step's and reads a LossBatch as `LossInputs`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch


@dataclass
class SequenceBatch:
    input_ids: list[list[int]]
    prompt_lens: list[int]
    global_index: list[int]  # position in the global batch: defines shuffling, so layouts agree
    response_len: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # each [n, response_len]
    # MoE routing replay: per sequence, the rollout's experts [tokens, num_layers, topk] (None: not recorded)
    routes: list[torch.Tensor | None] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def response_mask(self) -> torch.Tensor:
        return self.tensors["response_mask"]

    def select(self, rows: list[int]) -> "SequenceBatch":
        idx = torch.as_tensor(rows, dtype=torch.long)
        return SequenceBatch(
            [self.input_ids[r] for r in rows],
            [self.prompt_lens[r] for r in rows],
            [self.global_index[r] for r in rows],
            self.response_len,
            {k: v.index_select(0, idx) for k, v in self.tensors.items()},
            None if self.routes is None else [self.routes[r] for r in rows],
        )


def response_positions(prompt_lens: torch.Tensor, response_len: int, seq_lens: torch.Tensor | int) -> torch.Tensor:
    """[n, response_len] indices into one sequence's per-position outputs (output at position t
    predicts token t+1) for its response tokens; slots past a sequence's end are clamped to its
    last predicting position, seq_len - 2 (they are masked out)."""
    j = torch.arange(response_len).unsqueeze(0)
    last = torch.as_tensor(seq_lens).reshape(-1, 1) - 2
    return torch.minimum(prompt_lens.unsqueeze(1) - 1 + j, last).clamp_min(0)


@dataclass(frozen=True)
class ModelOutputs:
    """What a forward computes per response token, each [b, R] (None where not asked for): the
    log-probs and entropy of the sampling distribution (a policy), the values (a value model)."""

    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None


@dataclass(frozen=True)
class LossBatch:
    """One micro-batch as a loss reads it: its rows' response mask [b, R], their response tokens
    (counted on the host when the micro-batch was built) and the per-token fields the caller asked
    train_step for, by name, each [b, R] (filler rows are zeros)."""

    response_mask: torch.Tensor
    response_tokens: float
    fields: Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Totals:
    """The whole mini-batch's valid tokens and non-empty sequences (summed over DP ranks), which
    every micro-batch's loss contribution is normalised by (megarl.algorithms.agg_loss)."""

    tokens: float
    seqs: float


# loss_fn(outputs, micro_batch, totals) -> (loss contribution, {metric: value}). A metric value is a
# float or a 0-d tensor: tensors are summed where they are and read once per train_step (no host
# synchronisation inside the loss).
LossFn = Callable[[ModelOutputs, LossBatch, Totals], "tuple[torch.Tensor, dict[str, float | torch.Tensor]]"]
