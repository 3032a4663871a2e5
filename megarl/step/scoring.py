"""Samples and their scores, shared by the training rollout, validation and ReMax's greedy
baseline: `to_samples` turns an engine's results into Sample records (the reward's text decoded),
`SampleScorer` scores them with the reward function, the environments' rewards and DAPO's overlong
penalty (reward.overlong_buffer, megarl.rewards.overlong)."""
from __future__ import annotations

from typing import Callable

from megarl.data.dataset import PromptRow
from megarl.rewards.decode import response_text
from megarl.rewards.overlong import overlong_penalty
from megarl.step.samples import Sample


def to_samples(tokenizer, prompts: list[PromptRow], results, sampling) -> list[Sample]:
    """The engine's results (megarl.rollout.base.RolloutResult) for `prompts` as Sample records,
    cut to sampling.max_new_tokens, the reward's text decoded up to a stop token of `sampling`."""
    by_index = {p.global_index: p for p in prompts}
    samples = []
    for result in results:
        response = list(result.response_token_ids)[: sampling.max_new_tokens]
        scaled = result.scaled_logprobs is not None
        samples.append(Sample(by_index[result.prompt_index], result.sample_index, response,
                              list(result.scaled_logprobs if scaled else result.logprobs), scaled,
                              response_text(tokenizer, response, sampling.stop_token_ids), result.routed_experts,
                              tuple(result.versions[: len(response)]) if result.versions is not None else None,
                              result.response_mask, result.env_reward, result.episode, result.server))
    return samples


class SampleScorer:
    """The score of each sample: the reward function's, plus the environment's (multi-turn), plus
    DAPO's overlong penalty when reward.overlong_buffer.len is set (`overlong_buffer`: that section;
    max_new_tokens: rollout.max_new_tokens)."""

    def __init__(self, reward_fn: Callable[..., list[float]], overlong_buffer, max_new_tokens: int):
        self.reward_fn, self.overlong_buffer, self.max_new_tokens = reward_fn, overlong_buffer, max_new_tokens

    def __call__(self, samples: list[Sample]) -> list[float]:
        prompts = [s.prompt for s in samples]
        scores = self.reward_fn([p.prompt for p in prompts], [s.text for s in samples], [p.ground_truth for p in prompts],
                                [p.data_source for p in prompts], [p.extra for p in prompts])
        scores = [score + s.env_reward for score, s in zip(scores, samples)]  # multi-turn environments' rewards
        buffer = self.overlong_buffer
        if buffer.len:
            scores = [score + overlong_penalty(len(s.response_ids), self.max_new_tokens, buffer.len,
                                               buffer.penalty_factor) for score, s in zip(scores, samples)]
        return scores
