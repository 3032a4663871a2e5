"""On-policy distillation: the per-token reverse KL from the policy to a teacher, as a reward or a loss.

The policy samples y ~ pi; a frozen teacher q scores the same tokens. The sampled token's log-ratio
    rkl_t = log pi(y_t | y_<t) - log q(y_t | y_<t)
is the single-sample (k1) estimate of the reverse KL(pi || q) at position t, unbiased; summed over
a response it estimates the sequence-level KL(pi(.|x) || q(.|x)). Minimising it is mode seeking:
the student is pushed off what the teacher finds unlikely, on the states the student itself visits
(Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes", GKD, arXiv:2306.13649; K. Lu and Thinking Machines Lab, "On-Policy Distillation", 2025,
https://thinkingmachines.ai/blog/on-policy-distillation; Qwen3 technical report, arXiv:2505.09388,
"Strong-to-Weak Distillation").

Two ways in (algorithm.distill.mode):
    reward  r_t += coef * (teacher_logp_t - logp_t)         the negative reverse KL as a dense reward,
                                                            before the advantages (any estimator)
    loss    loss += coef * agg(k1+(logp_t, teacher_logp_t))  beside the policy loss, as actor.use_kl_loss
The loss uses the straight-through "k1+" estimator of megarl.algorithms.kl: its value is k1 (the
reverse-KL estimate the metrics report), its gradient that of k2 = 0.5 (logp - teacher_logp)^2,
i.e. (logp - teacher_logp) * grad logp, whose expectation under pi is the gradient of the
per-token reverse KL; k1's own gradient, grad logp, has expectation zero and would teach nothing.

Shapes: [batch, response_len]; the response mask is 1 on policy tokens only, so a multi-turn
episode's environment tokens (mask 0) neither earn the reward nor enter the loss.
"""
from __future__ import annotations

import torch

from megarl.algorithms.functional import masked_sum
from megarl.algorithms.kl import kl_penalty
from megarl.algorithms.losses import agg_loss

DISTILL_MODES = ("reward", "loss")


def _check_shapes(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"these tensors must all have the same shape [batch, response_len], got {shapes}")


def reverse_kl_per_token(logp: torch.Tensor, teacher_logp: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[batch, response_len] k1 estimate of KL(pi || teacher) per sampled token, logp - teacher_logp, 0 off the mask."""
    _check_shapes(logp=logp, teacher_logp=teacher_logp, response_mask=response_mask)
    mask = response_mask.to(logp.dtype)
    # torch.where, not a product: log-probs off the mask may be garbage (even -inf)
    return torch.where(mask != 0, (logp - teacher_logp) * mask, torch.zeros((), dtype=logp.dtype))


@torch.no_grad()
def distill_token_rewards(token_rewards: torch.Tensor, logp: torch.Tensor, teacher_logp: torch.Tensor,
                          response_mask: torch.Tensor, coef: float) -> torch.Tensor:
    """mode=reward: [batch, response_len] token_rewards + coef * (teacher_logp - logp) on policy tokens.

    logp: the sampling policy's log-probs of its own tokens (the old log-probs); the term is the
    negative per-token reverse KL, so a response the teacher agrees with loses nothing."""
    _check_shapes(token_rewards=token_rewards, logp=logp)
    return token_rewards - coef * reverse_kl_per_token(logp, teacher_logp, response_mask)


@torch.no_grad()
def distill_sequence_rewards(logp: torch.Tensor, teacher_logp: torch.Tensor, response_mask: torch.Tensor,
                             coef: float) -> torch.Tensor:
    """[batch] the reward term summed over each response: -coef * (sequence reverse-KL estimate).

    What the estimators that read one score per sequence (GRPO, RLOO, ReMax) add to the score, as
    their inputs read token-level rewards (megarl.algorithms.advantages: pass token_rewards.sum(-1))."""
    return -coef * masked_sum(reverse_kl_per_token(logp, teacher_logp, response_mask), response_mask, dim=-1)


def distill_loss(logp: torch.Tensor, teacher_logp: torch.Tensor, response_mask: torch.Tensor, mode: str,
                 **totals) -> torch.Tensor:
    """mode=loss: this micro-batch's contribution to the aggregated per-token reverse KL (without coef).

    logp: the current policy's log-probs (with gradient); aggregation `mode` and `totals` as in
    megarl.algorithms.agg_loss. Value k1, gradient k2's (see the module docstring)."""
    _check_shapes(logp=logp, teacher_logp=teacher_logp, response_mask=response_mask)
    # off the mask the teacher equals the policy (log-ratio 0): garbage there (nan, -inf) would reach
    # the gradient through k2 even though agg_loss masks the value
    teacher_logp = torch.where(response_mask != 0, teacher_logp.to(logp.dtype), logp.detach())
    return agg_loss(kl_penalty(logp, teacher_logp, "k1+"), response_mask, mode, **totals)
