"""rollout.placement=colocated: the engine runs on the training ranks, between the phases that train."""
from __future__ import annotations

from megarl.hybrid.dispatch import generate_for_training
from megarl.rollout.base import RolloutRequest, SamplingParams
from megarl.rollout.multi_turn import env_rows
from megarl.rollout_side.base import StepSamples, WeightHandOver
from megarl.step.samples import Sample


class LocalRollout:
    """The colocated side: hand-over through the 3D-HybridEngine, generation dispatched over the
    rollout groups (megarl.hybrid.dispatch), the step's prompts drawn from the data as it goes."""

    def __init__(self, engine, weight_path: str, hand_over: WeightHandOver, dispatch, data, sampling: SamplingParams,
                 to_samples, episodes: bool = False):
        """episodes: rollout.multi_turn is on: the engine runs an environment episode per sample, and
        Environment.reset reads each prompt's row (`use_rows`)."""
        self.engine, self.weight_path, self._hand_over = engine, weight_path, hand_over
        self.dispatch, self.data, self.sampling, self._to_samples = dispatch, data, sampling, to_samples
        self.episodes = episodes

    def hand_over(self, step: int):
        return self._hand_over(self.engine)

    def samples(self, step: int) -> StepSamples:
        return StepSamples(self.generate(self.data.next_step(), self.sampling, step))

    def generate(self, prompts, sampling: SamplingParams, step: int) -> list[Sample]:
        """sampling.n responses to each of this DP rank's prompts, prompt-major. Generation is
        seeded by (seed, step, prompt, sample), so it does not depend on the layout."""
        requests = [RolloutRequest(tuple(p.prompt_ids), prompt_index=p.global_index, step=step) for p in prompts]
        if self.episodes:
            self.engine.use_rows(env_rows(prompts))
        return self._to_samples(prompts, generate_for_training(self.engine, requests, sampling, self.dispatch), sampling)

    def release_memory(self) -> None:
        self.engine.release_memory()

    def delta_copy_bytes(self) -> int:
        return self._hand_over.hybrid.delta_copy_bytes()

    def data_state(self, current: dict) -> dict:
        return current

    def close(self) -> None:
        pass
