"""Reward-model scoring: a scalar-head model (HF `*ForSequenceClassification` with `score.weight`,
or a critic megarl exported) run under the training layout, scoring the last token.

It has its own tokenizer, so it may differ from the actor's: prompts and responses arrive as text.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megarl.data.tokenizer import load_tokenizer
from megarl.engine.batch import SequenceBatch
from megarl.engine.engine import EngineConfig, MegatronEngine
from megarl.distributed.parallel import ParallelDims
from megarl.models.weights import SafetensorsDir


class RewardModel:
    """`RewardFn` over a Megatron scalar-head model; a collective call on every rank of the job."""

    def __init__(self, model_dir: str, dims: ParallelDims, dtype: str = "float32", max_tokens_per_microbatch: int = 16384,
                 sequence_packing: bool = True):
        if "score.weight" not in SafetensorsDir(model_dir).weight_map:
            raise ValueError(f"reward.model_path: {model_dir} has no score.weight; a reward model needs a scalar head "
                             f"(a *ForSequenceClassification checkpoint with num_labels=1, or an exported megarl critic)")
        self.engine = MegatronEngine(model_dir, dims, EngineConfig(dtype=dtype, max_tokens_per_microbatch=max_tokens_per_microbatch,
                                                                 sequence_packing=sequence_packing),
                                     value_head=True, trainable=False)
        self.tokenizer = load_tokenizer(model_dir, key="reward.model_path")

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], ground_truths: Sequence[str],
                 data_sources: Sequence[str], extras: Sequence[dict]) -> list[float]:
        sequences = [list(self.tokenizer.encode(p + r)) for p, r in zip(prompts, responses)]
        pad = self.tokenizer.pad_token_id or 0
        # One placeholder "response" token per sequence: the engine then reads the value at the
        # position of the last real token, i.e. after the model has seen the whole text.
        batch = SequenceBatch([s + [pad] for s in sequences], [len(s) for s in sequences], list(range(len(sequences))), 1,
                              {"response_mask": torch.ones(len(sequences), 1)})
        return self.engine.forward_only(batch).values[:, 0].tolist()
