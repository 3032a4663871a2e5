"""What one PPO step computes, as typed, immutable records (issue 29; torchtune's `Trajectory`).

Shapes: n = this data-parallel rank's sequences of the step, R = `batch.response_len` (the longest
response of the *global* batch, so every rank has the same R); per-token tensors are [n, R],
left-aligned (response token j of sequence i at [i, j]), zero past a response's end. A micro-batch
holds b rows of the step (b <= n; filler rows are zeros).

The trainer builds each record once, from the phase that computes it:
    Scores      3 score        old log-probs, entropy, reference log-probs, values, teacher log-probs
    Correction  3 score        algorithm.rollout_correction's importance weights and loss mask
    StepRecord  5 advantages   everything above plus rewards, advantages and returns
and the updates read the StepRecord; `ppo_step` returns a StepResult (metrics and guard events). The engine works on `SequenceBatch` with per-token tensors by
name; the names live here only (`StepRecord.critic_batch` / `actor_batch` write them,
`LossInputs.of` reads a micro-batch back), so neither the trainer nor a loss spells one.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from megarl.engine.batch import LossBatch, SequenceBatch

# the per-token tensors of a SequenceBatch the engine cuts into micro-batches, by name
_MASK, _OLD_LOGPROBS, _REF_LOGPROBS, _OLD_VALUES = "response_mask", "old_logprobs", "ref_logprobs", "old_values"
_ADVANTAGES, _RETURNS, _IS_WEIGHTS = "advantages", "returns", "rollout_is_weights"
_TEACHER_LOGPROBS = "teacher_logprobs"


class StepResult(NamedTuple):
    """What one `ppo_step` (or one of its checks) returns: its metrics and the guard events that
    fired, (name, fields)."""

    metrics: dict[str, float]
    events: list[tuple[str, dict]]


@dataclass(frozen=True)
class Scores:
    """Phase 3: the models' scores of the step's samples.

    old_logprobs: [n, R] the actor's log-probs of the sampled tokens before the update (the
        sampling distribution: logits / temperature without the banned tokens), 0 off the mask.
    entropy: [n, R] the actor's entropy of that distribution at each response position.
    ref_logprobs: [n, R] the reference policy's log-probs; None without a KL term.
    values: [n, R] the critic's value of the state before each response token; None without a critic.
    teacher_logprobs: [n, R] algorithm.distill's teacher's log-probs of the sampled tokens (the same
        distribution as the reference's), 0 off the mask; None without distillation.
    """

    old_logprobs: torch.Tensor
    entropy: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None


@dataclass(frozen=True)
class Correction:
    """algorithm.rollout_correction of the step (megarl.step.rollout_corr.apply).

    weights: [n, R] truncated importance weights for the actor's loss; None when the mode has none.
    loss_mask: [n, R] the response mask without rejected tokens / sequences: the actor trains on it
        (its loss totals count only those tokens); None when nothing is rejected.
    metrics: the rollout_corr/ metrics, identical on every rank.
    """

    weights: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StepRecord:
    """Everything one PPO step computed for its updates, on this DP rank.

    batch: the sequences (prompt + response token ids), prompt lengths, global sample indices,
        R and the MoE routes; its only per-token tensor is the response mask.
    response_mask: [n, R] 1 on the policy's response tokens (float32).
    scored: phase 3's `Scores` (old and reference log-probs, entropy, the critic's old values).
    scores: [n] the reward function's score of each sample (plus environment and overlong terms).
    token_rewards: [n, R] the score on the last policy token, minus the KL penalty when it is in the reward,
        plus algorithm.distill's per-token term in its reward mode.
    advantages, returns: [n, R] this rank's rows of the global batch's advantages and returns, masked.
    correction: the rollout correction's weights and loss mask (`Correction`).
    """

    batch: SequenceBatch
    response_mask: torch.Tensor
    scored: Scores
    scores: torch.Tensor
    token_rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    correction: Correction

    def critic_batch(self) -> SequenceBatch:
        """The critic's training batch: old values and returns under the response mask."""
        return self._engine_batch(self.response_mask, {_OLD_VALUES: self.scored.values, _RETURNS: self.returns})

    def actor_batch(self, kl_loss: bool, distill_loss: bool = False) -> SequenceBatch:
        """The actor's training batch: old log-probs, advantages, the reference log-probs under the
        KL loss, the teacher's under the distillation loss and the correction's weights; the
        correction's loss mask, when it rejects, is the response mask (so the loss's totals count
        only what the update uses, as verl's rejection does)."""
        mask = self.correction.loss_mask if self.correction.loss_mask is not None else self.response_mask
        return self._engine_batch(mask, {_OLD_LOGPROBS: self.scored.old_logprobs, _ADVANTAGES: self.advantages,
                                         **({_REF_LOGPROBS: self.scored.ref_logprobs} if kl_loss else {}),
                                         **({_TEACHER_LOGPROBS: self.scored.teacher_logprobs} if distill_loss else {}),
                                         **({_IS_WEIGHTS: self.correction.weights} if self.correction.weights is not None else {})})

    def _engine_batch(self, mask: torch.Tensor, tensors: dict[str, torch.Tensor]) -> SequenceBatch:
        return replace(self.batch, tensors={_MASK: mask, **tensors})


def fields_of(batch: SequenceBatch) -> tuple[str, ...]:
    """The per-token fields of a `StepRecord` training batch the engine puts into micro-batches."""
    return tuple(name for name in batch.tensors if name != _MASK)


@dataclass(frozen=True)
class LossInputs:
    """A micro-batch's rows of the step record, as a loss reads them: each [b, R] (None where the
    role's batch does not carry it); response_tokens is the mask's sum, counted on the host."""

    response_mask: torch.Tensor
    response_tokens: float
    old_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None

    @classmethod
    def of(cls, mb: LossBatch) -> "LossInputs":
        """From the engine's micro-batch (the fields `StepRecord.critic_batch` / `actor_batch` named)."""
        f = mb.fields
        return cls(mb.response_mask, mb.response_tokens, f.get(_OLD_LOGPROBS), f.get(_ADVANTAGES), f.get(_REF_LOGPROBS),
                   f.get(_IS_WEIGHTS), f.get(_OLD_VALUES), f.get(_RETURNS), f.get(_TEACHER_LOGPROBS))


