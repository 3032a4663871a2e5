"""SGLang 0.5.23 adapter: one offline `sglang.Engine` per rollout group, owned by its lowest rank.

SGLang has no SPMD mode: `Engine` spawns its own scheduler process per TP rank. Following
/work/shared/notes/rollout-engines.md ("Per-step call sequences", SGLang), for a group of T
consecutive ranks on one node:
1. startup (owner only): Engine(model_path, tp_size=T, base_gpu_id=<owner LOCAL_RANK>,
   gpu_id_step=1, nccl_port=<unique per engine>, enable_memory_saver=True, load_format="dummy",
   skip_tokenizer_init=True, random_seed, enable_deterministic_inference), then
   release_memory_occupation(tags=["kv_cache", "weights"]);
2. load_weights: owner resume_memory_occupation(["weights"]) + begin_weight_update(); per bucket
   every rank serializes its own full tensors, gather_object to the owner, owner calls
   update_weights_from_tensor(named_tensors=[(name, LocalSerializedTensor(values=[...]))],
   flush_cache=False), barrier, ipc_collect; owner end_weight_update(), flush_cache();
3. resume_memory: owner resume_memory_occupation(["kv_cache"]); generate on the owner with one
   request per sample (distinct sampling_seed), results broadcast to the group;
4. release_memory: owner release_memory_occupation(["kv_cache", "weights"]).
"""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from megarl.rollout.base import RolloutRequest, RolloutResult, SamplingParams, expand_samples, import_engine

TARGET_SGLANG_VERSION = "0.5.23"
_ALL_TAGS = ("kv_cache", "weights")


def import_sglang():
    return import_engine("sglang", TARGET_SGLANG_VERSION)


@dataclass
class SGLangConfig:
    """tp_size: ranks per engine (consecutive, on one node). nccl_port_base: engine k uses base + k.

    deterministic: enable_deterministic_inference, without which SGLang ignores per-request
    seeds (samples then differ run to run). mem_fraction_static: fraction of the memory *free at
    engine start*. update_bucket_bytes: bytes serialized per update_weights_from_tensor call.
    """

    hf_dir: str
    tp_size: int = 1
    random_seed: int = 0
    nccl_port_base: int = 23456
    mem_fraction_static: float | None = None
    dtype: str = "auto"
    deterministic: bool = True
    update_bucket_bytes: int = 512 << 20
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")


def engine_kwargs(config: SGLangConfig, group_index: int, base_gpu_id: int) -> dict[str, Any]:
    """The sglang.Engine(...) keyword arguments for rollout group `group_index` (pure; unit-tested)."""
    kwargs: dict[str, Any] = dict(
        model_path=config.hf_dir,
        tp_size=config.tp_size,
        base_gpu_id=base_gpu_id,  # SGLang TP rank r runs on GPU base_gpu_id + r: the group's GPUs
        gpu_id_step=1,
        nccl_port=config.nccl_port_base + group_index,  # unset, engines on one node can collide
        enable_memory_saver=True,
        load_format="dummy",
        skip_tokenizer_init=True,
        random_seed=config.random_seed + group_index,
        enable_deterministic_inference=config.deterministic,
        dtype=config.dtype,
    )
    if config.mem_fraction_static is not None:
        kwargs["mem_fraction_static"] = config.mem_fraction_static
    kwargs.update(config.engine_kwargs)
    return kwargs


def to_sglang_sampling(sampling: SamplingParams, seed: int) -> dict[str, Any]:
    """One request's sampling dict (SGLang rejects unknown keys such as max_tokens or seed)."""
    return {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "stop_token_ids": list(sampling.stop_token_ids),
        # SGLang 0.5.23 skips stop_token_ids too when ignore_eos is set (Req._check_token_based_finish
        # returns before looking at them; vLLM does not), so ignore_eos only when nothing is to stop a
        # response. Otherwise SGLang also stops on the model's own eos ids, which the trainer lists
        # here anyway; rollout.ignore_eos with stop ids cannot be expressed and the config refuses it.
        "ignore_eos": not sampling.stop_token_ids,
        "sampling_seed": seed,
        # Banned tokens: -inf before the softmax, so they also leave the log-probs SGLang returns.
        **({"logit_bias": {str(t): float("-inf") for t in sampling.banned_token_ids}} if sampling.banned_token_ids else {}),
    }


# torchrun marks its workers with TORCHELASTIC_USE_AGENT_STORE=True. SGLang's scheduler processes
# inherit the environment at spawn, and torch's c10d rendezvous then makes every one of them a client
# of the store at tcp://127.0.0.1:<nccl_port> (the agent's, it assumes), so nobody serves that port
# and all of them retry until the store times out. The owner's own process group is already up.
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"


@contextmanager
def hidden_agent_store():
    """Remove AGENT_STORE_VAR from os.environ while SGLang spawns its schedulers; restore it after."""
    saved = os.environ.pop(AGENT_STORE_VAR, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[AGENT_STORE_VAR] = saved


def parse_output(out: dict) -> tuple[list[int], list[float], str]:
    """(output_ids, per-token logprobs, finish reason type) from one Engine.generate result."""
    meta = out["meta_info"]
    logprobs = [float(lp) for lp, _tok, _text in meta["output_token_logprobs"]]
    ids = list(out["output_ids"])
    if len(logprobs) != len(ids):
        raise RuntimeError(f"SGLang returned {len(ids)} output ids but {len(logprobs)} logprobs")
    reason = meta["finish_reason"]
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return ids, logprobs, kind if kind in ("stop", "length") else "abort"


def _check(result, what: str) -> None:
    if isinstance(result, tuple) and len(result) >= 1 and not result[0]:
        raise RuntimeError(f"SGLang {what} failed: {result[1] if len(result) > 1 else result}")


class SGLangRolloutEngine:
    """RolloutEngine over sglang.Engine; construct on every rank of the group (owner builds it).

    group: process group of the rollout group's ranks (None when tp_size == 1); group_ranks: its
    global ranks, consecutive, the owner first.
    """

    record_routes = False  # no routing replay from this engine yet (docs/moe_routing.md): validation refuses it

    def __init__(self, config: SGLangConfig, *, group, group_ranks: Sequence[int]):
        group_ranks = list(group_ranks)
        if len(group_ranks) != config.tp_size or group_ranks != list(range(group_ranks[0], group_ranks[0] + config.tp_size)):
            raise ValueError(f"SGLang TP groups are {config.tp_size} consecutive ranks (GPU base_gpu_id + r); got {group_ranks}")
        self.config, self.group, self.group_ranks = config, group, group_ranks
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.owner = group_ranks[0]
        self.is_owner = self.rank == self.owner
        self.group_rank = group_ranks.index(self.rank)
        self.group_index = self.owner // config.tp_size
        sglang = import_sglang()
        # deferred: optional (sglang extra)
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        self._serializer = MultiprocessingSerializer
        self._patch_reductions = monkey_patch_torch_reductions
        self.engine = None
        self._released: set[str] = set()
        if not config.deterministic and self.is_owner:
            warnings.warn("SGLang ignores sampling_seed unless enable_deterministic_inference=True: samples will not be "
                          "reproducible or layout independent", stacklevel=2)
        if self.is_owner:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + config.tp_size)))
            if local_rank + config.tp_size > local_world:
                raise ValueError(f"rollout group {group_ranks} spans nodes (owner LOCAL_RANK {local_rank} + tp {config.tp_size} > "
                                 f"{local_world} GPUs per node); megarl's SGLang adapter supports single-node TP groups")
            # deferred: optional (sglang extra)
            from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

            self._local_serialized_tensor = LocalSerializedTensor
            with hidden_agent_store():
                self.engine = sglang.Engine(**engine_kwargs(config, self.group_index, local_rank))
            self.engine.release_memory_occupation(tags=list(_ALL_TAGS))
            self._released = set(_ALL_TAGS)

    # ---------------------------------------------------------------- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full HF tensors; every rank of the group passes the same names in the same order."""
        self._patch_reductions()  # CUDA IPC handles by GPU UUID, robust to CUDA_VISIBLE_DEVICES
        if self.is_owner:
            self._resume(["weights"])
            _check(self.engine.begin_weight_update(), "begin_weight_update")
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in weights:
            bucket.append((name, tensor.detach()))
            size += tensor.numel() * tensor.element_size()
            if size >= self.config.update_bucket_bytes:
                self._push(bucket)
                bucket, size = [], 0
        if bucket:
            self._push(bucket)
        if self.is_owner:
            _check(self.engine.end_weight_update(), "end_weight_update")
            self.engine.flush_cache()

    def _push(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """One update_weights_from_tensor call; values[r] must come from SGLang TP rank r's GPU."""
        payload = [(name, self._serializer.serialize(t)) for name, t in bucket]
        if self.config.tp_size > 1:
            gathered = [None] * self.config.tp_size if self.is_owner else None
            dist.gather_object(payload, gathered, dst=self.owner, group=self.group)
        else:
            gathered = [payload]
        if self.is_owner:
            names = [name for name, _ in payload]
            for r, other in enumerate(gathered):
                if [n for n, _ in other] != names:
                    raise RuntimeError(f"rollout group rank {r} streamed different weight names than the owner")
            named = [(name, self._local_serialized_tensor(values=[gathered[r][i][1] for r in range(self.config.tp_size)]))
                     for i, name in enumerate(names)]
            _check(self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=False), "update_weights_from_tensor")
        if self.config.tp_size > 1:
            dist.barrier(group=self.group)  # producers keep `bucket` alive until every scheduler copied it
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()

    # ---------------------------------------------------------------- generation
    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        """Every rank of the group calls this with the same requests; the owner runs the engine."""
        specs = expand_samples(requests, sampling)
        parsed = None
        if self.is_owner:
            if self._released:
                raise RuntimeError(f"SGLang memory {sorted(self._released)} is released: call load_weights() and resume_memory() first")
            outputs = self.engine.generate(
                input_ids=[list(s.request.prompt_token_ids) for s in specs],
                sampling_params=[to_sglang_sampling(sampling, s.seed) for s in specs],
                return_logprob=True,
            )
            if len(outputs) != len(specs):
                raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {len(specs)} requests")
            parsed = [parse_output(o) for o in outputs]
        if self.config.tp_size > 1:
            box = [parsed]
            dist.broadcast_object_list(box, src=self.owner, group=self.group)
            parsed = box[0]
        # SGLang's log-probs are temperature-scaled and untruncated, taken after it added logit_bias in
        # place (sampling_batch_info.py:440-441 in 0.5.23): banned tokens are already out of them, which
        # is the trainer's definition of the policy too (docs/algorithms.md, "Banned tokens").
        return [RolloutResult(s.request.prompt_index, s.sample_index, ids, lps, reason, scaled_logprobs=list(lps))
                for s, (ids, lps, reason) in zip(specs, parsed)]

    # ---------------------------------------------------------------- memory
    def _resume(self, tags: list[str]) -> None:
        todo = [t for t in tags if t in self._released]  # resuming a tag that is not released fails
        if todo:
            self.engine.resume_memory_occupation(tags=todo)
            self._released -= set(todo)

    def resume_memory(self) -> None:
        if self.is_owner:
            self._resume(["kv_cache"])

    def release_memory(self) -> None:
        if self.is_owner:
            todo = [t for t in _ALL_TAGS if t not in self._released]
            if todo:
                self.engine.release_memory_occupation(tags=todo)
                self._released |= set(todo)

    def close(self) -> None:
        if self.engine is not None:
            shutdown = getattr(self.engine, "shutdown", None)  # not in the API note; present in SGLang's Engine
            if shutdown is not None:
                shutdown()
        self.engine = None
