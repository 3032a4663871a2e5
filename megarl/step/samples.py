"""The step's sample records: one `Sample` per generated response, and the `RolloutBatch` the trainer
builds from this DP rank's samples (token batch + the engine's log-probs).

Training rollout, validation and the ReMax greedy baseline all generate and score through the
same two functions (`megarl.step.scoring.to_samples` and `SampleScorer`), which produce and consume these.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megarl.data.dataset import PromptRow
from megarl.engine.batch import SequenceBatch


@dataclass(frozen=True)
class Sample:
    """One response to one prompt."""

    prompt: PromptRow  # the dataset row: text, token ids, ground truth, data source, extras, global index
    sample_index: int  # 0 .. samples_per_prompt - 1
    response_ids: list[int]  # truncated to max_new_tokens
    logprobs: list[float]  # per response token, from the engine: temperature-scaled where it reports them
    logprobs_are_scaled: bool  # False: the engine reported top-k/top-p-processed log-probs only
    text: str  # the decoded response, what the reward reads
    # MoE routing replay: the engine's experts [tokens, layers, topk] (RolloutResult.routed_experts)
    routes: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # per response token: the policy version it was sampled under (asynchronous training; None
    # when the engine does not say). logprobs are then the behaviour policy's log-probs.
    versions: tuple[int, ...] | None = None
    # multi-turn episodes (megarl.rollout.multi_turn): 1 on the policy's tokens, 0 on the
    # environment's; None = all the policy's. env_reward is added to the score; episode: counts.
    response_mask: list[int] | None = None
    env_reward: float = 0.0
    episode: dict | None = field(default=None, compare=False)
    server: str | None = None  # rollout.placement=fleet: the rollout server that generated it

    @property
    def oldest_version(self) -> int | None:
        """The version of the sample's oldest token: what its staleness is counted from."""
        return min(self.versions) if self.versions else None

    @property
    def prompt_index(self) -> int:
        """The prompt's index in the step's global batch (the group of GRPO/RLOO)."""
        return self.prompt.global_index


def id_records(samples: list[Sample]) -> list[list]:
    """What identifies each trained sample (tracking.sample_ids): [dataset row, prompt index,
    sample index, the policy version of each token or None], and under rollout.placement=fleet the
    server that generated it (the versions are then the fleet's weights versions)."""
    return [[s.prompt.row, s.prompt_index, s.sample_index, list(s.versions) if s.versions else None]
            + ([s.server] if s.server is not None else []) for s in samples]


def merge_id_records(parts: list[list[list]]) -> list[list]:
    """Every rank's id_records as one list in global-batch order, each sample once (the ranks of a
    model-parallel group hold the same samples)."""
    unique = {(r[1], r[2]): r for part in parts for r in part}
    return [unique[key] for key in sorted(unique)]


@dataclass
class RolloutBatch:
    """This DP rank's samples of one step as the engines consume them."""

    samples: list[Sample]
    batch: SequenceBatch  # [m sequences]; per-token fields [m, R] are added phase by phase
    rollout_logprobs: torch.Tensor  # [m, R] the engine's log-probs of its own samples
    logprobs_are_scaled: bool  # every sample's log-probs are temperature-scaled (comparable to the actor's)
    group_ids: torch.Tensor  # [m] global prompt index


def to_rollout_batch(samples: list[Sample], samples_per_prompt: int, response_len: int) -> RolloutBatch:
    """Samples -> right-padded [m, response_len] response mask and log-probs, and the token batch.
    A sample's position in the global batch is prompt_index * samples_per_prompt + sample_index,
    which fixes the update's shuffling independently of the layout."""
    mask = torch.zeros(len(samples), response_len)
    rollout_logprobs = torch.zeros(len(samples), response_len)
    for i, sample in enumerate(samples):
        length = len(sample.response_ids)
        mask[i, :length] = 1.0 if sample.response_mask is None else torch.tensor(sample.response_mask[:length], dtype=torch.float32)
        rollout_logprobs[i, :length] = torch.tensor(sample.logprobs[:length], dtype=torch.float32)
    batch = SequenceBatch([list(s.prompt.prompt_ids) + s.response_ids for s in samples],
                          [len(s.prompt.prompt_ids) for s in samples],
                          [s.prompt_index * samples_per_prompt + s.sample_index for s in samples],
                          response_len, {"response_mask": mask},
                          [s.routes for s in samples] if any(s.routes is not None for s in samples) else None)
    return RolloutBatch(samples, batch, rollout_logprobs, all(s.logprobs_are_scaled for s in samples),
                   torch.tensor([s.prompt_index for s in samples]))
