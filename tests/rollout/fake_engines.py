"""Stand-ins for vllm 0.33.0 and sglang 0.5.23 that record every call.

Their signatures and accepted keyword names are taken from /work/shared/notes/rollout-engines.md,
and they reject anything else, so a typo in an adapter fails here instead of on a GPU cluster.
"""
from __future__ import annotations

import os
import pickle
import random
import sys
import types
from dataclasses import dataclass

import numpy as np
import torch

# vllm.LLM: explicit constructor parameters (llm.py:177) plus the EngineArgs fields the note lists.
VLLM_LLM_KWARGS = {
    "model", "runner", "convert", "tokenizer", "tokenizer_mode", "skip_tokenizer_init", "trust_remote_code",
    "tensor_parallel_size", "dtype", "quantization", "revision", "seed", "gpu_memory_utilization", "cpu_offload_gb",
    "enforce_eager", "enable_return_routed_experts", "return_sampling_mask", "disable_custom_all_reduce", "hf_overrides",
    "compilation_config", "kv_cache_memory_bytes", "logits_processors",
    "distributed_executor_backend", "pipeline_parallel_size", "data_parallel_size", "enable_expert_parallel",
    "enable_sleep_mode", "sleep_mode_backend", "load_format", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "enable_prefix_caching", "enable_chunked_prefill", "logprobs_mode", "max_logprobs", "generation_config",
    "worker_extension_cls", "weight_transfer_config", "async_scheduling",
}
VLLM_SAMPLING_FIELDS = {
    "n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop_token_ids", "stop", "ignore_eos",
    "seed", "logprobs", "prompt_logprobs", "logprob_token_ids", "flat_logprobs", "detokenize", "skip_special_tokens",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "bad_words", "allowed_token_ids",
    "extra_args",
}
SGLANG_ENGINE_KWARGS = {
    "model_path", "tokenizer_path", "dtype", "trust_remote_code", "load_format", "skip_tokenizer_init", "context_length",
    "log_level", "tp_size", "pp_size", "dp_size", "ep_size", "nnodes", "node_rank", "dist_init_addr", "nccl_port", "port",
    "base_gpu_id", "gpu_id_step", "mem_fraction_static", "enable_memory_saver", "enable_weights_cpu_backup",
    "enable_draft_weights_cpu_backup", "random_seed", "enable_deterministic_inference", "custom_weight_loader", "weight_version",
}
SGLANG_SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids", "stop_regex", "ignore_eos",
    "skip_special_tokens", "no_stop_trim", "min_new_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty",
    "logit_bias", "sampling_seed", "custom_params",
}


def fake_tokens(seed: int, prompt: list[int], length: int = 3) -> list[int]:
    """What the fake engines 'generate': a function of (seed, prompt) only."""
    g = torch.Generator().manual_seed(seed + sum(prompt))
    return torch.randint(3, 100, (length,), generator=g).tolist()


# ------------------------------------------------------------------------------------------- vllm
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: None
    outputs: list[CompletionOutput]
    finished: bool = True


def make_fake_vllm(version: str = "0.33.0", sleep_mode: bool = True):
    """A fake `vllm` (and `vllm.platforms`, registered by install_fake_vllm). sleep_mode: what
    current_platform.is_sleep_mode_available() says (True on CUDA; the real CPU build says False,
    which tests/vllm runs against)."""
    calls: list[tuple] = []
    mod = types.ModuleType("vllm")
    mod.__version__ = version
    mod.calls = calls
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_sleep_mode_available=lambda: sleep_mode)
    mod.platforms = platforms
    # the CUDA build has Triton (so vLLM runs Model Runner V2), the CPU build does not
    mod.triton_utils = types.ModuleType("vllm.triton_utils")
    mod.triton_utils.HAS_TRITON = sleep_mode

    class SamplingParams:
        def __init__(self, **kw):
            unknown = set(kw) - VLLM_SAMPLING_FIELDS
            assert not unknown, f"vllm.SamplingParams has no fields {unknown}"
            self.__dict__.update(kw)

    def TokensPrompt(*, prompt_token_ids):  # a TypedDict in vllm
        return {"prompt_token_ids": prompt_token_ids}

    class LLM:
        def __init__(self, model, **kw):
            unknown = set(kw) - VLLM_LLM_KWARGS
            assert not unknown, f"vllm.LLM has no arguments {unknown}"
            if kw.get("enable_sleep_mode") and not sleep_mode:
                raise ValueError("Sleep mode is not supported on current platform.")  # the real CPU build's refusal
            calls.append(("LLM", dict(kw, model=model)))
            # constructing LLM reseeds python, numpy and torch process-wide (note A1 "Seeding")
            random.seed(0)
            np.random.seed(0)
            torch.manual_seed(0)
            self.asleep: set[str] = set()
            # vLLM's shutdown (EngineCore.shutdown -> cleanup_dist_env_and_memory) ends with
            # torch.distributed.destroy_process_group(): the default group, whoever created it
            self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=lambda timeout=None: _vllm_shutdown()))

        def sleep(self, level: int = 1, mode: str = "abort"):
            calls.append(("sleep", level))
            self.asleep = {"weights", "kv_cache"}

        def wake_up(self, tags=None):
            calls.append(("wake_up", tuple(tags) if tags is not None else None))
            self.asleep -= set(tags or ("weights", "kv_cache"))
            return not self.asleep

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            if method == "reload_weights":
                names = [n for n, _ in kwargs["weights_iterator"]]
                calls.append(("collective_rpc", method, kwargs["is_checkpoint_format"], names))
            else:
                calls.append(("collective_rpc", method))
            return [None]

        def reset_prefix_cache(self):
            calls.append(("reset_prefix_cache",))

        def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None,
                     tokenization_kwargs=None, mm_processor_kwargs=None):
            assert not self.asleep, "generate while asleep"
            calls.append(("generate", prompts, sampling_params, use_tqdm))
            outs = []
            for i, (p, sp) in enumerate(zip(prompts, sampling_params)):
                toks = fake_tokens(sp.seed, p["prompt_token_ids"])
                # logprobs=0 returns exactly the sampled token; add a decoy to check extraction
                lps = [{t: Logprob(-0.5 - j), t + 1: Logprob(-9.0)} for j, t in enumerate(toks)]
                outs.append(RequestOutput(str(i), None, p["prompt_token_ids"], None,
                                          [CompletionOutput(0, "", toks, None, lps, "length")]))
            return outs

    def _vllm_shutdown():
        calls.append(("shutdown",))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    mod.LLM, mod.SamplingParams, mod.TokensPrompt = LLM, SamplingParams, TokensPrompt
    return mod


def install_fake_vllm(monkeypatch, mod) -> None:
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.platforms", mod.platforms)
    monkeypatch.setitem(sys.modules, "vllm.triton_utils", mod.triton_utils)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)


# ----------------------------------------------------------------------------------------- sglang
@dataclass
class LocalSerializedTensor:
    values: list

    def get(self, rank: int):
        return self.values[rank]


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        return pickle.dumps(obj)

    @staticmethod
    def deserialize(data):
        return pickle.loads(data)


def make_fake_sglang(version: str = "0.5.23") -> dict[str, types.ModuleType]:
    calls: list[tuple] = []
    root = types.ModuleType("sglang")
    root.__version__ = version
    root.calls = calls
    srt = types.ModuleType("sglang.srt")
    utils = types.ModuleType("sglang.srt.utils")
    utils.MultiprocessingSerializer = MultiprocessingSerializer
    patch = types.ModuleType("sglang.srt.utils.patch_torch")
    patch.monkey_patch_torch_reductions = lambda: calls.append(("monkey_patch_torch_reductions",))
    me = types.ModuleType("sglang.srt.model_executor")
    mrc = types.ModuleType("sglang.srt.model_executor.model_runner_components")
    wu = types.ModuleType("sglang.srt.model_executor.model_runner_components.weight_updater")
    wu.LocalSerializedTensor = LocalSerializedTensor

    class Engine:
        # The model's own eos ids (SGLang reads them from the checkpoint's config); tests set them.
        model_eos_token_ids: tuple[int, ...] = ()

        def __init__(self, **kw):
            unknown = set(kw) - SGLANG_ENGINE_KWARGS
            assert not unknown, f"sglang ServerArgs has no fields {unknown}"
            calls.append(("Engine", kw))
            # The real Engine spawns one scheduler process per TP rank here; each starts with a copy
            # of os.environ as it is at this moment (what a torchrun variable leaking in would reach).
            self.scheduler_env = dict(os.environ)
            self.tp_size = kw.get("tp_size", 1)
            self.released: set[str] = set()
            self.in_update = False
            self.weights: dict[str, list[torch.Tensor]] = {}

        def release_memory_occupation(self, tags=None):
            calls.append(("release_memory_occupation", tuple(tags)))
            self.released |= set(tags or ("kv_cache", "weights", "cuda_graph"))

        def resume_memory_occupation(self, tags=None):
            calls.append(("resume_memory_occupation", tuple(tags)))
            for t in tags:
                self.released.remove(t)  # set.remove: resuming an unreleased tag fails, as in SGLang

        def begin_weight_update(self, selector: str = "all"):
            calls.append(("begin_weight_update",))
            self.in_update = True
            return True, ""

        def end_weight_update(self):
            calls.append(("end_weight_update",))
            self.in_update = False
            return True, ""

        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
            if not self.in_update:
                return False, "must run between begin_weight_update() and end_weight_update()"
            calls.append(("update_weights_from_tensor", [n for n, _ in named_tensors], flush_cache))
            for name, lst in named_tensors:
                assert len(lst.values) == self.tp_size
                self.weights[name] = [MultiprocessingSerializer.deserialize(v) for v in lst.values]
            return True, "ok"

        def flush_cache(self):
            calls.append(("flush_cache",))

        def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False, **kw):
            assert not self.released, f"generate with released memory {self.released}"
            calls.append(("generate", input_ids, sampling_params, return_logprob))
            outs = []
            for ids, sp in zip(input_ids, sampling_params):
                unknown = set(sp) - SGLANG_SAMPLING_KEYS
                assert not unknown, f"sglang sampling params have no keys {unknown}"
                toks = fake_tokens(sp["sampling_seed"], ids, sp.get("max_new_tokens", 3))
                finish = {"type": "length", "length": len(toks)}
                # SGLang 0.5.23's token-based finish (Req._check_token_based_finish): with ignore_eos it
                # returns at once, so stop_token_ids are skipped as well as eos; otherwise the first
                # token in stop_token_ids or the model's eos ids ends the response and is kept.
                if not sp.get("ignore_eos", False):
                    stops = set(sp.get("stop_token_ids") or ()) | set(self.model_eos_token_ids)
                    hit = next((j for j, t in enumerate(toks) if t in stops), None)
                    if hit is not None:
                        toks, finish = toks[:hit + 1], {"type": "stop", "matched": toks[hit]}
                outs.append({"output_ids": toks, "meta_info": {
                    "id": "x", "finish_reason": finish,
                    "output_token_logprobs": [(-0.25 * (j + 1), t, None) for j, t in enumerate(toks)]}})
            return outs

        def shutdown(self):
            calls.append(("shutdown",))

    root.Engine = Engine
    root.srt, srt.utils, utils.patch_torch = srt, utils, patch
    srt.model_executor, me.model_runner_components, mrc.weight_updater = me, mrc, wu
    return {m.__name__: m for m in (root, srt, utils, patch, me, mrc, wu)}


def install(modules: dict[str, types.ModuleType]) -> None:
    sys.modules.update(modules)


def sglang_two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    """Rank body of the two-rank SGLang test (here so spawned children import little)."""
    import json

    import torch.distributed as dist

    from megarl.rollout.base import RolloutRequest, SamplingParams
    from megarl.rollout.sglang import SGLangConfig, SGLangRolloutEngine

    install(make_fake_sglang())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    engine = SGLangRolloutEngine(SGLangConfig("/m", tp_size=2), group=group, group_ranks=[0, 1])
    # each rank contributes its own copy (on GPU: its own device's tensor); rank r's value is r
    engine.load_weights([("w", torch.full((3,), float(rank))), ("v", torch.full((1,), 10.0 + rank))])
    engine.resume_memory()
    results = engine.generate([RolloutRequest((4, 5), 0)], SamplingParams(n=2, max_new_tokens=3, seed=3))
    report = {"ids": [r.response_token_ids for r in results]}
    if rank == 0:
        report["w"] = [t.tolist() for t in engine.engine.weights["w"]]
        report["calls"] = [c[0] for c in sys.modules["sglang"].calls]
    with open(f"{out_dir}/{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
