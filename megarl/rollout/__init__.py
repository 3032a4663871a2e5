"""Rollout engines: the RolloutEngine protocol and its hf (default), vllm and sglang implementations.

`build_rollout` is the one place that knows each backend's option names and the weight layout
each engine's `load_weights` accepts; the trainer hands it the rollout groups (ParallelDims owns
them) and gets back the engine and that layout.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megarl.layout import RolloutLayout, check_rollout
from megarl.models.convert import to_hf, weight_mappings
from megarl.models.families import load_spec
from megarl.rollout.base import (MissingEngineError, RolloutEngine, RolloutRequest, RolloutResult, SamplingParams,
                                 make_sample_seed, pad_results)
from megarl.rollout.vllm_direct import choose, config_problem
from megarl.rollout.vllm_lora import adapter_sync_reason

ENGINES = ("hf", "vllm", "sglang")

# vLLM on CPU: a fixed KV cache (its memory fraction would be of the whole host) and eager mode
# (torch.compile of the model costs minutes on CPU and gains nothing at demo sizes).
CPU_VLLM_KV_CACHE_BYTES = 256 << 20


def vllm_memory_options(cpu: bool, memory_fraction: float | None) -> dict:
    """VLLMConfig's memory options: on CPU a fixed KV cache and eager mode, on a GPU the fraction of
    its memory vLLM may take (None: vLLM's own default). Colocated engines and fleet servers
    (megarl.rollout.serve) both take them from here."""
    if cpu:
        return {"kv_cache_memory_bytes": CPU_VLLM_KV_CACHE_BYTES, "enforce_eager": True}
    return {"gpu_memory_utilization": memory_fraction}


def build_rollout_engine(name: str, hf_dir: str, *, tp: int = 1, seed: int = 0, device: str = "cpu",
                         dtype: torch.dtype = torch.float32, group=None, group_ranks=None, **options) -> RolloutEngine:
    """Build engine `name` for the model in `hf_dir` (config.json; weights arrive via load_weights).

    tp: ranks per engine instance (consecutive global ranks). group/group_ranks: that instance's
    process group and ranks (SGLang only). dtype: the trainer's parameter dtype, which every
    engine computes in. options: fields of the engine's own config (HFRolloutEngine.from_hf_dir,
    VLLMConfig, SGLangConfig).
    """
    check_rollout(name, tp)  # the hf engine: rollout.tp 1 (checked with the config, before any model exists)
    if name == "hf":
        from megarl.rollout.hf import HFRolloutEngine  # deferred: the engine rollout.engine chooses (hf: transformers)

        return HFRolloutEngine.from_hf_dir(hf_dir, dtype=dtype, device=device, **options)
    elif name == "vllm":
        # deferred: the engine rollout.engine chooses (vllm: optional)
        from megarl.rollout.vllm import VLLMConfig, VLLMRolloutEngine, vllm_dtype

        options.setdefault("dtype", vllm_dtype(dtype))
        return VLLMRolloutEngine(VLLMConfig(hf_dir=hf_dir, tensor_parallel_size=tp, seed=seed, **options))
    elif name == "sglang":
        # deferred: the engine rollout.engine chooses (sglang: optional)
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
    accepts, for the HybridEngine, and convert: canonical Megatron name + tensor of that layout ->
    what `load_weights` takes. weight_path: "adapter" (actor.lora into vLLM: the base once, then
    only the adapters, megarl.hybrid.lora_sync), "direct" (vLLM, dense families: each rank receives
    exactly its rollout shard, written into vLLM's own sharded parameters,
    megarl.rollout.vllm_direct) or "full" (full HF tensors on every rank, sliced by the engine:
    the hf engine, SGLang, vLLM for MoE and anything the direct path does not cover);
    weight_path_reason says why. groups: the engine instance's ranks
    (megarl.distributed.parallel.RolloutGroups), for dispatching prompts.
    """

    engine: RolloutEngine
    weight_layout: object
    groups: object
    convert: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]
    weight_path: str = "full"
    weight_path_reason: str = ""


WEIGHT_SYNC_MODES = ("auto", "direct", "full")


def planned_weight_path(name: str, spec, tp: int, *, weight_sync: str = "auto", lora_rank: int = 0,
                        lora_targets=None) -> tuple[str, str, str | None]:
    """The weight path `build_rollout` takes, decided from the config and the model's config.json
    alone: (path, why, why not the adapter path). "direct" means the config allows it: build_rollout
    then confirms it against vLLM's own model (megarl.rollout.vllm_direct.choose) and falls back to
    "full" where vLLM's model differs. The dry run (megarl.tools.dryrun_sync) plans with the same
    answer, so the two cannot drift apart. spec: the model's ModelSpec (read only for vLLM or LoRA;
    None will do for the other engines without adapters)."""
    no_adapter_path = "actor.lora is off"
    if lora_rank > 0:
        no_adapter_path = ("weight_sync='full' asked for full (merged) weights" if weight_sync == "full"
                           else adapter_sync_reason(name, lora_rank, lora_targets, spec.is_moe))
    if no_adapter_path is None:
        return "adapter", (f"the base weights once as full HF tensors, then only the actor's rank-{lora_rank} "
                           "adapters, which vLLM applies as a LoRA"), None
    if name != "vllm":
        return "full", f"rollout.engine={name} loads full HF tensors", no_adapter_path
    if weight_sync == "full":
        return "full", "weight_sync='full' asked for full HF tensors", no_adapter_path

    problem = config_problem(spec, tp)
    if problem is not None:
        return "full", f"the direct path does not apply: {problem}", no_adapter_path
    return "direct", f"each rank receives its rollout tp{tp} shard and writes it into vLLM's sharded parameters", no_adapter_path


def build_rollout(name: str, hf_dir: str, groups, *, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
                  memory_fraction: float | None = None, max_model_len: int | None = None, train_tp: int = 1,
                  weight_sync: str = "auto", log: Callable[[str], None] | None = print, lora_rank: int = 0,
                  lora_targets=None, record_routes: bool = False) -> RolloutSetup:
    """The engine for rollout groups `groups` (ParallelDims.rollout_groups(tp)) and its weight layout.

    memory_fraction: the accelerator memory the engine may take (vLLM gpu_memory_utilization,
    SGLang mem_fraction_static; unused by hf and by vLLM on CPU). max_model_len: prompt +
    response tokens (vLLM sizes its KV cache blocks with it). train_tp: the actor's tensor
    parallelism (its padded vocabulary). weight_sync: "auto" takes the direct path wherever it
    applies, "full" always sends full HF tensors, "direct" refuses to fall back. Collective over the
    default group (vLLM: the engine and the path decision). log: rank 0 says which path runs.
    record_routes: the engine returns each sample's experts (actor.routing_replay; validation
    keeps it to the engines that can). lora_rank, lora_targets: the actor's adapters (actor.lora); where the engine takes them as a
    LoRA (vLLM, megarl.hybrid.lora_sync) the path is "adapter": the base weights once as full HF
    tensors, then only the adapters; elsewhere the merged weights go the usual way.
    """
    if weight_sync not in WEIGHT_SYNC_MODES:
        raise ValueError(f"weight_sync must be one of {WEIGHT_SYNC_MODES}, got {weight_sync!r}")

    cpu = torch.device(device).type == "cpu"
    options: dict = {}
    # config.json is read where the path depends on it (the engines read their own)
    spec = load_spec(hf_dir) if lora_rank > 0 or (name == "vllm" and weight_sync != "full") else None
    path, why, no_adapter_path = planned_weight_path(name, spec, groups.size, weight_sync=weight_sync, lora_rank=lora_rank,
                                                     lora_targets=lora_targets)
    if path == "adapter":
        options["lora_rank"] = lora_rank
    if name == "vllm":
        options.update(max_model_len=max_model_len, **vllm_memory_options(cpu, memory_fraction))
    elif name == "sglang":
        options["mem_fraction_static"] = memory_fraction
    engine = build_rollout_engine(name, hf_dir, tp=groups.size, seed=seed, device=device, dtype=dtype,
                                  group=groups.group, group_ranks=list(groups.ranks), **options)
    if record_routes:
        engine.record_routes = True  # MoE routing replay: each result carries its tokens' experts
    setup = RolloutSetup(engine=engine, weight_layout=RolloutLayout(tp=1), groups=groups,
                         convert=full_hf_converter(hf_dir, train_tp), weight_path="adapter" if path == "adapter" else "full",
                         weight_path_reason=why)
    # the config allows the direct path, or rules it out with its reason; only vLLM's model can confirm it
    # (choose asks every rank's, collectively; its own check repeats the config's, so a "full" plan ends the same)
    if name == "vllm" and path != "adapter" and weight_sync != "full":
        direct = choose(engine, spec, groups.size)
        if isinstance(direct, str):
            if weight_sync == "direct":
                raise ValueError(f"weight_sync='direct' but the direct path does not apply: {direct}; use 'auto' or 'full'")
            setup.weight_path_reason = f"the direct path does not apply: {direct}"
        else:
            engine.use_direct_weights()
            setup.weight_layout, setup.convert, setup.weight_path = direct.layout, direct.convert, "direct"
            setup.weight_path_reason = why
    if lora_rank > 0 and no_adapter_path is not None:
        setup.weight_path_reason += f"; merged LoRA weights, not adapter-only: {no_adapter_path}"
    if log is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        log(f"megarl: weight sync into rollout.engine={name}: {setup.weight_path} path ({setup.weight_path_reason})")
    return setup


def full_hf_converter(hf_dir: str, train_tp: int):
    """Canonical full tensor -> its HF tensors (megarl.models.convert.to_hf); the model's
    config.json is read at the first call."""
    mappings: dict = {}

    def convert(name: str, full: torch.Tensor):
        if not mappings:
            mappings.update({m.name: m for m in weight_mappings(load_spec(hf_dir), train_tp)})
        return to_hf(mappings[name], full)

    return convert


__all__ = ["ENGINES", "full_hf_converter", "MissingEngineError", "RolloutEngine", "RolloutRequest", "RolloutResult", "RolloutSetup", "SamplingParams",
           "build_rollout", "build_rollout_engine", "make_sample_seed", "pad_results", "vllm_memory_options"]
