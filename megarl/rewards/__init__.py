"""Scoring of responses: rule rewards (gsm8k, arithmetic), user functions, a reward model.

Everything that scores is a `RewardFn`: batched, one float per response. `build_reward_fn`
turns `reward.*` config into one; the reward model is built by the trainer (it needs the
parallel layout) and handed in.
"""
from __future__ import annotations

import math
from typing import Protocol, Sequence

from megarl.config import ConfigError, RewardConfig
from megarl.rewards.arithmetic import arithmetic_score
from megarl.rewards.function import UserFunctionReward, load_function
from megarl.rewards.gsm8k import extract_answer, gsm8k_score

__all__ = ["RewardFn", "RuleReward", "NoTaskReward", "UserFunctionReward", "CheckedReward", "RewardError", "build_reward_fn", "rule_for_data_source",
           "arithmetic_score", "gsm8k_score", "extract_answer", "load_function"]


class RewardFn(Protocol):
    """Scores a batch of responses; all lists have one entry per response."""

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], ground_truths: Sequence[str],
                 data_sources: Sequence[str], extras: Sequence[dict]) -> list[float]: ...


def rule_for_data_source(data_source: str) -> str:
    """'openai/gsm8k' -> 'gsm8k', 'arithmetic/copy' -> 'arithmetic' (reward.kind=auto)."""
    if "gsm8k" in data_source.lower():
        return "gsm8k"
    if data_source.startswith("arithmetic"):
        return "arithmetic"
    raise ValueError(f"no rule reward for data_source {data_source!r}: set reward.kind "
                     f"(gsm8k, arithmetic, function or model)")


class RuleReward:
    """gsm8k / arithmetic rule rewards; kind 'auto' picks the rule per row from its data_source."""

    def __init__(self, kind: str = "auto", gsm8k_method: str = "strict", format_score: float = 0.0):
        assert kind in ("auto", "gsm8k", "arithmetic"), kind
        self.kind, self.gsm8k_method, self.format_score = kind, gsm8k_method, format_score

    def __call__(self, prompts, responses, ground_truths, data_sources, extras) -> list[float]:
        scores = []
        for response, truth, source in zip(responses, ground_truths, data_sources):
            rule = self.kind if self.kind != "auto" else rule_for_data_source(source)
            if rule == "gsm8k":
                scores.append(gsm8k_score(response, truth, self.gsm8k_method, self.format_score))
            else:
                scores.append(arithmetic_score(response, truth))
        return scores


class NoTaskReward:
    """reward.kind=none: every response scores 0, so only algorithm.distill's teacher teaches
    (on-policy distillation alone); the data's ground truth is not read."""

    def __call__(self, prompts, responses, ground_truths, data_sources, extras) -> list[float]:
        return [0.0] * len(responses)


class RewardError(ValueError):
    """A reward function returned something that is not a finite score."""


class CheckedReward:
    """A RewardFn that fails loudly on NaN / inf / non-numeric scores, naming the function and samples.

    A NaN score would otherwise reach the advantages, trip the NaN guard on every step (each
    update skipped) and end the run with exit 0 and a null score. Under torch.distributed the
    check is collective (every rank calls the reward at the same point): all ranks raise the
    same message, so rank 0 can print it once, whichever rank's samples were bad.
    """

    def __init__(self, inner: RewardFn, name: str):
        self.inner, self.name = inner, name

    def __call__(self, prompts, responses, ground_truths, data_sources, extras) -> list[float]:
        scores = self.inner(prompts, responses, ground_truths, data_sources, extras)
        bad = []
        if len(scores) != len(responses):
            bad.append(f"returned {len(scores)} scores for {len(responses)} responses")
        else:
            for i, score in enumerate(scores):
                try:
                    ok = math.isfinite(float(score))
                except (TypeError, ValueError):
                    ok = False
                if not ok:
                    bad.append(f"sample {i}: score {score!r} for prompt {prompts[i][-60:]!r} response {responses[i][:60]!r}")
        bad_everywhere = _gather_problems(bad)
        if bad_everywhere:
            count = sum(len(b) for b in bad_everywhere)
            shown = "; ".join(f"rank {rank} {p}" for rank, problems in enumerate(bad_everywhere) for p in problems[:2])
            raise RewardError(f"reward {self.name} returned {count} non-finite or non-numeric scores ({shown}); "
                              f"every score must be a finite number: fix the reward function")
        return [float(s) for s in scores]


def _gather_problems(local: list[str]) -> list[list[str]]:
    """Every rank's problem list (only this rank's outside torch.distributed); empty if none anywhere."""
    try:
        import torch.distributed as dist  # deferred: torch; megarl.rewards (scoring in plain Python) is imported without it
    except ImportError:  # pragma: no cover - torch is a dependency
        dist = None
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
        return everyone if any(everyone) else []
    return [local] if local else []


def reward_name(cfg: RewardConfig) -> str:
    """How errors name the configured reward: the user's function, the model path, or the rule."""
    if cfg.kind == "function":
        return f"reward.function={cfg.function}"
    if cfg.kind == "model":
        return f"reward.model_path={cfg.model_path}"
    return f"reward.kind={cfg.kind}"


def build_reward_fn(cfg: RewardConfig, reward_model: RewardFn | None = None) -> RewardFn:
    """The RewardFn that `reward.*` describes (checked: non-finite scores raise RewardError);
    kind=model wraps the trainer-built `reward_model`."""
    if cfg.kind == "function":
        return CheckedReward(UserFunctionReward(cfg.function), reward_name(cfg))
    if cfg.kind == "model":
        if reward_model is None:
            raise ConfigError("reward.kind=model: the trainer must build the reward model from reward.model_path "
                              "and pass it to build_reward_fn")
        return CheckedReward(reward_model, reward_name(cfg))
    if cfg.kind == "none":
        return NoTaskReward()
    return CheckedReward(RuleReward(cfg.kind, cfg.gsm8k_method, cfg.format_score), reward_name(cfg))
