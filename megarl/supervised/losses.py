"""The supervised losses as pure functions (no distributed code: the engine sums the contributions).

SFT: the negative log-likelihood of the response tokens, averaged over every response token of the
global batch (as PPO's token-mean: the loss is the same whatever the split into micro-batches and DP
ranks, megarl.algorithms.agg_loss).

Reward model: Bradley-Terry (Ouyang et al. 2022, eq. 1; Stiennon et al. 2020): for a pair with scores
r_c (chosen) and r_r (rejected), loss = -log sigmoid(r_c - r_r), averaged over the global batch's pairs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def sft_loss_contribution(logprobs: torch.Tensor, mask: torch.Tensor, total_tokens: float) -> torch.Tensor:
    """-sum(logprobs * mask) / total_tokens: this micro-batch's share of the token-mean NLL.

    logprobs, mask: [rows, response_len]; total_tokens: response tokens of the whole global batch.
    E.g. logprobs [[-1, -3]], mask [[1, 1]], total 4 -> 1.0 (the other micro-batches bring the rest)."""
    return -(logprobs * mask).sum() / total_tokens


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per pair [P]: loss -log sigmoid(r_c - r_r), accuracy 1[r_c > r_r], margin r_c - r_r.

    E.g. chosen [1.0], rejected [1.0] -> loss log 2 = 0.6931, accuracy 0, margin 0."""
    margin = chosen - rejected
    return {"loss": F.softplus(-margin), "accuracy": (margin > 0).to(margin.dtype), "margin": margin}


def bradley_terry_score_grads(chosen: torch.Tensor, rejected: torch.Tensor, total_pairs: float) -> tuple[torch.Tensor, torch.Tensor]:
    """d(mean loss over total_pairs) / d r_c and / d r_r, per pair [P]: -sigmoid(r_r - r_c) / total_pairs and its negation.

    The reward-model step reads every pair's scores first (a forward pass), then trains on
    sum_i grad_i * r_i over the sequences: its gradient is exactly that of the Bradley-Terry loss at
    these weights, although a pair's two sequences may sit in different micro-batches (the engine's
    loss sees one micro-batch at a time). Exact because the forward is deterministic (no dropout)."""
    g = torch.sigmoid(rejected - chosen) / total_pairs
    return -g, g
