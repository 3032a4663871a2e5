"""algorithm.filter_groups (DAPO's dynamic sampling) around a rollout side: rounds of generation
until data.prompts_per_step groups have a score spread (megarl.step.dynamic_sampling)."""
from __future__ import annotations

from megarl.rollout_side.base import RolloutSide, StepSamples
from megarl.step.dynamic_sampling import generate_filtered


class DynamicSampling:
    """Every member but `samples` is the inner side's; `samples` generates through the inner side's
    `generate` with the current weights (under separate placement too: its rounds cannot be
    requested ahead, their count depends on the scores) and scores as it filters."""

    def __init__(self, inner: RolloutSide, data, sampling, score, global_batch, *, prompts_per_step: int, max_rounds: int,
                 dp_rank: int, dp_size: int):
        self.inner, self.data, self.sampling, self.score, self.global_batch = inner, data, sampling, score, global_batch
        self.prompts_per_step, self.max_rounds, self.dp_rank, self.dp_size = prompts_per_step, max_rounds, dp_rank, dp_size

    @property
    def engine(self):
        return self.inner.engine

    @property
    def weight_path(self) -> str:
        return self.inner.weight_path

    def samples(self, step: int) -> StepSamples:
        """Scored samples of prompts_per_step groups with a score spread, this rank's block;
        collective over the DP group."""
        filtered = generate_filtered(self.data.next_step, lambda prompts: self.inner.generate(prompts, self.sampling, step),
                                     self.score, self.global_batch.gather_objects, prompts_per_step=self.prompts_per_step,
                                     samples_per_prompt=self.sampling.n, max_rounds=self.max_rounds, dp_rank=self.dp_rank,
                                     dp_size=self.dp_size)
        return StepSamples(filtered.samples, filtered.scores, filtered.metrics)

    def hand_over(self, step: int):
        return self.inner.hand_over(step)

    def generate(self, prompts, sampling, step: int):
        return self.inner.generate(prompts, sampling, step)

    def release_memory(self) -> None:
        self.inner.release_memory()

    def delta_copy_bytes(self) -> int:
        return self.inner.delta_copy_bytes()

    def data_state(self, current: dict) -> dict:
        return self.inner.data_state(current)

    def close(self) -> None:
        self.inner.close()
