"""algorithm.distill in the trainer: on-policy distillation from a frozen teacher (docs/algorithms.md,
"On-policy distillation"; the math is megarl.algorithms.distill).

The teacher is a `MegatronEngine` built exactly as the reference model is (the trainer hands it over:
frozen, the training layout, ref.param_offload), from algorithm.distill.teacher_path. It may be larger
than the student but must share its vocabulary, since it scores the student's token ids. The trainer
calls one `Distillation`, chosen when it is built, at three places of its step:

    3 score     teacher_logprobs = distill.score(batch, temperature, banned)   like the reference's
    4 rewards   distill.shape_rewards(...)   mode reward: the per-token term into the token rewards
                                             (and, summed, into the scores GRPO / RLOO / ReMax read)
    6 update    distill.loss(...)            mode loss: the reverse KL beside the policy loss

and adds `distill.metrics(...)` (`distill/reverse_kl`, `distill/teacher_logp_mean`: one reduction over
the global batch) to the step's. Everything is masked by the response mask: in multi-turn episodes
the environment's tokens are neither scored nor trained.
"""
from __future__ import annotations

from pathlib import Path

import torch

from megarl import algorithms as A
from megarl.config.schema import DistillConfig
from megarl.data.tokenizer import TOKENIZER_FILES, load_tokenizer
from megarl.engine.batch import SequenceBatch
from megarl.engine.engine import MegatronEngine
from megarl.step.global_batch import GlobalBatch, LocalStats


class Distillation:
    """The teacher and its terms; `RewardDistillation` or `LossDistillation` by algorithm.distill.mode."""

    in_loss = False  # the actor's batch carries the teacher's log-probs only for the loss

    def __init__(self, cfg: DistillConfig, teacher: MegatronEngine, global_batch: GlobalBatch):
        self.coef, self.teacher, self.global_batch = cfg.coef, teacher, global_batch

    def score(self, batch: SequenceBatch, temperature: float, banned_token_ids: tuple[int, ...]) -> torch.Tensor:
        """[n, R] the teacher's log-probs of the sampled tokens under the distribution the policy
        sampled from (logits / temperature, banned tokens removed), 0 off the response mask."""
        logprobs = self.teacher.forward_only(batch, temperature=temperature, banned_token_ids=banned_token_ids).logprobs
        self.teacher.offload()  # as configured (ref.param_offload): frozen weights out of the update's way
        return logprobs

    def shape_rewards(self, token_rewards: torch.Tensor, scores: torch.Tensor, old_logprobs: torch.Tensor,
                      teacher_logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([n, R] token rewards, [n] scores) for the advantage estimators: unchanged here."""
        return token_rewards, scores

    def loss(self, logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor, agg_mode: str,
             **totals) -> torch.Tensor | None:
        """This micro-batch's reverse-KL loss contribution (without coef); None: no loss term."""
        return None

    def metrics(self, old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        """distill/reverse_kl (mean over the global batch's policy tokens of logp - teacher_logp, the
        sampling policy's) and distill/teacher_logp_mean; one reduction, identical on every rank."""
        stats = LocalStats()
        stats.masked_mean("distill/reverse_kl", A.reverse_kl_per_token(old_logprobs, teacher_logprobs, mask), mask)
        stats.masked_mean("distill/teacher_logp_mean", teacher_logprobs, mask)
        return self.global_batch.reduce(stats)


class RewardDistillation(Distillation):
    """mode=reward: coef * (teacher_logp - logp) on each policy token's reward, before the advantages."""

    def shape_rewards(self, token_rewards, scores, old_logprobs, teacher_logprobs, mask):
        """GAE and REINFORCE++ read the token rewards; GRPO, RLOO and ReMax one score per sequence, to
        which the term's sum over the response is added (the task score itself, reported as
        critic/score/*, stays as the reward function gave it)."""
        token_rewards = A.distill_token_rewards(token_rewards, old_logprobs, teacher_logprobs, mask, self.coef)
        return token_rewards, scores + A.distill_sequence_rewards(old_logprobs, teacher_logprobs, mask, self.coef)


class LossDistillation(Distillation):
    """mode=loss: coef * the aggregated per-token reverse KL beside the actor's policy loss."""

    in_loss = True

    def loss(self, logprobs, teacher_logprobs, mask, agg_mode, **totals):
        return A.distill_loss(logprobs, teacher_logprobs, mask, agg_mode, **totals)


def build_distillation(cfg: DistillConfig, teacher: MegatronEngine, student: MegatronEngine, student_dir: str,
                       global_batch: GlobalBatch) -> Distillation:
    """The configured mode's `Distillation`; ValueError (one line) when the teacher cannot score the
    student's tokens: another vocabulary size, or tokenizers that map tokens to other ids."""
    key = "algorithm.distill.teacher_path"
    if teacher.spec.vocab_size != student.spec.vocab_size:
        raise ValueError(f"{key}: the teacher {cfg.teacher_path} has a vocabulary of {teacher.spec.vocab_size} tokens, the "
                         f"student (model.path) {student.spec.vocab_size}: distillation needs a teacher with the student's "
                         f"tokenizer")
    if _has_tokenizer(cfg.teacher_path) and _has_tokenizer(student_dir):
        if load_tokenizer(cfg.teacher_path, key=key).get_vocab() != load_tokenizer(student_dir).get_vocab():
            raise ValueError(f"{key}: the tokenizer of {cfg.teacher_path} maps tokens to other ids than model.path's "
                             f"({student_dir}): distillation needs a teacher with the student's tokenizer")
    return (LossDistillation if cfg.mode == "loss" else RewardDistillation)(cfg, teacher, global_batch)


def _has_tokenizer(model_dir: str) -> bool:
    return any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES)
