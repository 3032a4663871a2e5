"""Rollout engines: the RolloutEngine protocol and its hf (default), vllm and sglang implementations.

`build_rollout` is the one place that knows each backend's option names and the weight layout
each engine's `load_weights` accepts; the trainer hands it the rollout groups (ParallelDims owns
them) and gets back the engine and that layout.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch

from megarl.rollout.base import (MissingEngineError, RolloutEngine, RolloutRequest, RolloutResult, SamplingParams,
                                 make_sample_seed, pad_results)

ENGINES = ("hf", "vllm", "sglang")

# vLLM on CPU: a fixed KV cache (its memory fraction would be of the whole host) and eager mode
# (torch.compile of the model costs minutes on CPU and gains nothing at demo sizes).
CPU_VLLM_KV_CACHE_BYTES = 256 << 20


def build_rollout_engine(name: str, hf_dir: str, *, tp: int = 1, seed: int = 0, device: str = "cpu",
                         dtype: torch.dtype = torch.float32, group=None, group_ranks=None, **options) -> RolloutEngine:
    """Build engine `name` for the model in `hf_dir` (config.json; weights arrive via load_weights).

    tp: ranks per engine instance (consecutive global ranks). group/group_ranks: that instance's
    process group and ranks (SGLang only). dtype: the trainer's parameter dtype, which every
    engine computes in. options: fields of the engine's own config (HFRolloutEngine.from_hf_dir,
    VLLMConfig, SGLangConfig).
    """
    if name == "hf":
        if tp != 1:
            raise ValueError(f"the hf engine runs one model per rank (rollout tp 1), got tp={tp}; use vllm or sglang for tp > 1")
        from megarl.rollout.hf import HFRolloutEngine

        return HFRolloutEngine.from_hf_dir(hf_dir, dtype=dtype, device=device, **options)
    elif name == "vllm":
        from megarl.rollout.vllm import VLLMConfig, VLLMRolloutEngine, vllm_dtype

        options.setdefault("dtype", vllm_dtype(dtype))
        return VLLMRolloutEngine(VLLMConfig(hf_dir=hf_dir, tensor_parallel_size=tp, seed=seed, **options))
    elif name == "sglang":
        from megarl.rollout.sglang import SGLangConfig, SGLangRolloutEngine
        from megarl.rollout.vllm import vllm_dtype  # same names

        if group_ranks is None:
            raise ValueError("the sglang engine needs group_ranks (and group when tp > 1): its rollout group's consecutive ranks")
        options.setdefault("dtype", vllm_dtype(dtype))
        return SGLangRolloutEngine(SGLangConfig(hf_dir=hf_dir, tp_size=tp, random_seed=seed, **options), group=group, group_ranks=group_ranks)
    near = difflib.get_close_matches(name, ENGINES, n=1)
    raise ValueError(f"unknown rollout engine {name!r}; choose one of {ENGINES}" + (f" (did you mean {near[0]!r}?)" if near else ""))


@dataclass
class RolloutSetup:
    """What the trainer needs to drive a rollout engine.

    engine: the RolloutEngine. weight_layout: the layout of the tensors its `load_weights`
    accepts, for the HybridEngine (tp 1 = full HF tensors on every rank: what the hf engine, vLLM's
    and SGLang's loaders take; they slice them per rank themselves). groups: the engine
    instance's ranks (megarl.parallel.RolloutGroups), for dispatching prompts.
    """

    engine: RolloutEngine
    weight_layout: object
    groups: object


def build_rollout(name: str, hf_dir: str, groups, *, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
                  memory_fraction: float | None = None, max_model_len: int | None = None) -> RolloutSetup:
    """The engine for rollout groups `groups` (ParallelDims.rollout_groups(tp)) and its weight layout.

    memory_fraction: the accelerator memory the engine may take (vLLM gpu_memory_utilization,
    SGLang mem_fraction_static; unused by hf and by vLLM on CPU). max_model_len: prompt +
    response tokens (vLLM sizes its KV cache blocks with it).
    """
    from megarl.hybrid.layout import RolloutLayout

    cpu = torch.device(device).type == "cpu"
    options: dict = {}
    if name == "vllm":
        options["max_model_len"] = max_model_len
        if cpu:
            options.update(kv_cache_memory_bytes=CPU_VLLM_KV_CACHE_BYTES, enforce_eager=True)
        else:
            options["gpu_memory_utilization"] = memory_fraction
    elif name == "sglang":
        options["mem_fraction_static"] = memory_fraction
    engine = build_rollout_engine(name, hf_dir, tp=groups.size, seed=seed, device=device, dtype=dtype,
                                  group=groups.group, group_ranks=list(groups.ranks), **options)
    return RolloutSetup(engine=engine, weight_layout=RolloutLayout(tp=1), groups=groups)


__all__ = ["ENGINES", "MissingEngineError", "RolloutEngine", "RolloutRequest", "RolloutResult", "RolloutSetup", "SamplingParams",
           "build_rollout", "build_rollout_engine", "make_sample_seed", "pad_results"]
