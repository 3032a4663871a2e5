"""Rollout engines: the RolloutEngine protocol and its hf (default), vllm and sglang implementations."""
from __future__ import annotations

import difflib

import torch

from megarl.rollout.base import (MissingEngineError, RolloutEngine, RolloutRequest, RolloutResult, SamplingParams,
                                 make_sample_seed, pad_results)

ENGINES = ("hf", "vllm", "sglang")


def build_rollout_engine(name: str, hf_dir: str, *, tp: int = 1, seed: int = 0, device: str = "cpu",
                         dtype: torch.dtype = torch.float32, group=None, group_ranks=None, **options) -> RolloutEngine:
    """Build engine `name` for the model in `hf_dir` (config.json; weights arrive via load_weights).

    tp: ranks per engine instance (consecutive global ranks). group/group_ranks: that instance's
    process group and ranks (SGLang only). options: fields of the engine's own config
    (HFRolloutEngine.from_hf_dir, VLLMConfig, SGLangConfig).
    """
    if name == "hf":
        if tp != 1:
            raise ValueError(f"the hf engine runs one model per rank (rollout tp 1), got tp={tp}; use vllm or sglang for tp > 1")
        from megarl.rollout.hf import HFRolloutEngine

        return HFRolloutEngine.from_hf_dir(hf_dir, dtype=dtype, device=device, **options)
    elif name == "vllm":
        from megarl.rollout.vllm import VLLMConfig, VLLMRolloutEngine

        return VLLMRolloutEngine(VLLMConfig(hf_dir=hf_dir, tensor_parallel_size=tp, seed=seed, **options))
    elif name == "sglang":
        from megarl.rollout.sglang import SGLangConfig, SGLangRolloutEngine

        if group_ranks is None:
            raise ValueError("the sglang engine needs group_ranks (and group when tp > 1): its rollout group's consecutive ranks")
        return SGLangRolloutEngine(SGLangConfig(hf_dir=hf_dir, tp_size=tp, random_seed=seed, **options), group=group, group_ranks=group_ranks)
    near = difflib.get_close_matches(name, ENGINES, n=1)
    raise ValueError(f"unknown rollout engine {name!r}; choose one of {ENGINES}" + (f" (did you mean {near[0]!r}?)" if near else ""))


__all__ = ["ENGINES", "MissingEngineError", "RolloutEngine", "RolloutRequest", "RolloutResult", "SamplingParams",
           "build_rollout_engine", "make_sample_seed", "pad_results"]
