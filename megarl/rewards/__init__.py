"""Scoring of responses: rule rewards (gsm8k, arithmetic), user functions, a reward model.

Everything that scores is a `RewardFn`: batched, one float per response. `build_reward_fn`
turns `reward.*` config into one; the reward model is built by the trainer (it needs the
parallel layout) and handed in.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from megarl.config import ConfigError, RewardConfig
from megarl.rewards.arithmetic import arithmetic_score
from megarl.rewards.function import UserFunctionReward, load_function
from megarl.rewards.gsm8k import extract_answer, gsm8k_score

__all__ = ["RewardFn", "RuleReward", "UserFunctionReward", "build_reward_fn", "rule_for_data_source",
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


def build_reward_fn(cfg: RewardConfig, reward_model: RewardFn | None = None) -> RewardFn:
    """The RewardFn that `reward.*` describes; kind=model returns the trainer-built `reward_model`."""
    if cfg.kind == "function":
        return UserFunctionReward(cfg.function)
    if cfg.kind == "model":
        if reward_model is None:
            raise ConfigError("reward.kind=model: the trainer must build the reward model from reward.model_path "
                              "and pass it to build_reward_fn")
        return reward_model
    return RuleReward(cfg.kind, cfg.gsm8k_method, cfg.format_score)
