"""vLLM 0.33.0 adapter: one in-process `LLM` per rank, SPMD under torchrun (external_launcher).

Follows /work/shared/notes/rollout-engines.md ("Per-step call sequences", vLLM):
1. startup, all ranks at once (constructing LLM is a collective over the default group):
   LLM(model=hf_dir, tensor_parallel_size=T, distributed_executor_backend="external_launcher",
   seed=<same in a group, different across groups>, load_format="dummy", enable_sleep_mode=True,
   logprobs_mode="processed_logprobs", ...), with the trainer's RNG saved and restored around it,
   then sleep(level=2);
2. load_weights: wake_up(tags=["weights"]); collective_rpc("reload_weights", kwargs={
   "weights_iterator": it, "is_checkpoint_format": True}) with full HF tensors; reset_prefix_cache();
3. resume_memory: wake_up(tags=["kv_cache"]) (True once fully awake); generate with one
   SamplingParams(n=1, seed=per-sample seed, logprobs=0, detokenize=False, ...) per sample;
4. release_memory: sleep(level=...).
vLLM's TP groups are blocks of T consecutive global ranks that run in lockstep: every rank of a
group must make the same calls with the same prompts (megarl.hybrid.dispatch does that).
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from megarl.rollout.base import RolloutRequest, RolloutResult, SamplingParams, expand_samples, import_engine

TARGET_VLLM_VERSION = "0.33.0"


def import_vllm():
    return import_engine("vllm", TARGET_VLLM_VERSION)


@dataclass
class VLLMConfig:
    """hf_dir needs config.json and tokenizer files (weights are not read: load_format="dummy").

    tensor_parallel_size: ranks per engine (consecutive global ranks). seed: engine seed of group 0;
    group k uses seed + k (per-request seeds decide the samples anyway). Memory: give either
    gpu_memory_utilization (fraction of *total* memory; startup fails unless that much is free)
    or kv_cache_memory_bytes (fixed KV size, independent of what the trainer holds).
    sleep_level: 2 drops weights while asleep (they are re-synced each step), 1 keeps a CPU copy.
    env: VLLM_* variables, set before LLM is constructed (vLLM caches env reads after startup).
    """

    hf_dir: str
    tensor_parallel_size: int = 1
    seed: int = 0
    dtype: str = "auto"
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    enforce_eager: bool = False
    sleep_level: int = 2
    env: dict[str, str] = field(default_factory=dict)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 (keep weights on CPU) or 2 (drop them), got {self.sleep_level}")


def _save_rng() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def engine_kwargs(config: VLLMConfig, group_index: int) -> dict[str, Any]:
    """The LLM(...) keyword arguments for rollout group `group_index` (pure; unit-tested)."""
    kwargs: dict[str, Any] = dict(
        model=config.hf_dir,
        tensor_parallel_size=config.tensor_parallel_size,
        distributed_executor_backend="external_launcher",
        seed=config.seed + group_index,  # same inside a TP group, different across ExternalDP replicas
        load_format="dummy",  # weights come from the trainer; reload_weights() from disk would fail
        enable_sleep_mode=True,
        logprobs_mode="processed_logprobs",  # the distribution actually sampled from (default is raw)
        dtype=config.dtype,
        enforce_eager=config.enforce_eager,
    )
    if config.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
    if config.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    kwargs.update(config.engine_kwargs)
    return kwargs


def to_vllm_sampling(vllm, sampling: SamplingParams, seed: int):
    """One single-sample vllm.SamplingParams; `n` is expanded by megarl so each sample has its seed."""
    banned = {"logit_bias": {t: float("-inf") for t in sampling.banned_token_ids}} if sampling.banned_token_ids else {}
    return vllm.SamplingParams(
        n=1, seed=seed, logprobs=0, max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
        top_p=sampling.top_p, top_k=sampling.top_k, stop_token_ids=list(sampling.stop_token_ids), detokenize=False, **banned,
    )


def sampled_logprobs(completion) -> list[float]:
    """Per position, the sampled token's logprob: completion.logprobs[j][token_ids[j]].logprob."""
    if completion.logprobs is None:
        raise RuntimeError("vLLM returned no logprobs; SamplingParams.logprobs=0 should always return the sampled token's")
    return [float(completion.logprobs[j][tok].logprob) for j, tok in enumerate(completion.token_ids)]


class VLLMRolloutEngine:
    """RolloutEngine over vLLM's in-process LLM; construct on every rank at the same point."""

    def __init__(self, config: VLLMConfig):
        vllm = import_vllm()
        for var in ("RANK", "LOCAL_RANK"):
            if var not in os.environ:
                raise ValueError(f"vLLM's external_launcher reads {var} from the environment; launch with torchrun")
        if not torch.distributed.is_initialized():
            raise ValueError("initialise torch.distributed (Megatron's groups) before building the vLLM engine: "
                             "with an existing group vLLM forms ExternalDP replicas of tensor_parallel_size consecutive ranks")
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        T = config.tensor_parallel_size
        if world % T:
            raise ValueError(f"world size {world} is not divisible by vLLM tensor_parallel_size {T}")
        self._vllm, self.config = vllm, config
        self.group_index = rank // T
        os.environ.update(config.env)
        rng = _save_rng()  # LLM() reseeds python, numpy, torch and CUDA process-wide
        self.llm = vllm.LLM(**engine_kwargs(config, self.group_index))
        _restore_rng(rng)
        self.llm.sleep(level=2)  # dummy weights need not be kept
        self._weights_awake = False
        self._kv_awake = False
        self._weights_valid = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full HF-checkpoint tensors, in layer order, every rank of the group the same stream.

        reload_weights (layerwise reload) runs vLLM's post-load processing per layer, which
        quantized and repacked MoE kernels need; it must see the whole model in one call.
        """
        if not self._weights_awake:
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # the prefix cache holds KV computed with the old weights
        self._weights_valid = True

    def resume_memory(self) -> None:
        if self._kv_awake:
            return
        if not self._weights_awake and self._weights_valid:  # sleep level 1: weights come back from CPU
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        awake = self.llm.wake_up(tags=["kv_cache"])
        self._kv_awake = True
        if awake is False:
            raise RuntimeError("vLLM reports it is not fully awake after wake_up(tags=['kv_cache']); call load_weights() first")

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        if not (self._weights_valid and self._weights_awake and self._kv_awake):
            # after sleep(level=2) the weight memory is garbage until reloaded (vllm#29341)
            raise RuntimeError("vLLM engine is asleep or has no synced weights: call load_weights() and resume_memory() first")
        vllm = self._vllm
        specs = expand_samples(requests, sampling)
        prompts = [vllm.TokensPrompt(prompt_token_ids=list(s.request.prompt_token_ids)) for s in specs]
        params = [to_vllm_sampling(vllm, sampling, s.seed) for s in specs]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        if len(outputs) != len(specs):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(specs)} prompts")
        results = []
        for s, out in zip(specs, outputs):
            c = out.outputs[0]
            results.append(RolloutResult(s.request.prompt_index, s.sample_index, list(c.token_ids), sampled_logprobs(c),
                                         c.finish_reason if c.finish_reason in ("stop", "length") else "abort"))
        return results

    def release_memory(self) -> None:
        if not (self._weights_awake or self._kv_awake):
            return
        self.llm.sleep(level=self.config.sleep_level)
        self._weights_awake = self._kv_awake = False
        if self.config.sleep_level == 2:
            self._weights_valid = False

    def close(self) -> None:
        self.llm = None
