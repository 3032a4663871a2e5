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
import os
import queue
import socket
import sys
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from megarl.fleet import link
from megarl.fleet.log import BackgroundLog
from megarl.fleet.mailbox import Mailbox
from megarl.fleet.wire import WireError, decode, encode
from megarl.rollout.base import MissingEngineError
from megarl.rollout.server_engines import Lockstep, ServerEngine, ServerEngineHost, follow, server_engine, server_world

# tests only: seconds a server waits before generating each request, so that a kill lands mid-request,
# and between two tokens of a request under async.partial_rollout, so that new weights land mid-request
TEST_DELAY_ENV = "MEGARL_FLEET_TEST_DELAY_S"
TEST_TOKEN_DELAY_ENV = "MEGARL_FLEET_TEST_TOKEN_DELAY_S"


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
        self.host = ServerEngineHost(engine_maker, log)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()  # (kind, header, session) for the engine's thread
        self.link_jobs: queue.SimpleQueue = queue.SimpleQueue()  # the same for the link's thread
        self.outbox = Mailbox()  # replies for the socket's thread, which it wakes
        self.session = 0  # the newest welcome's number (set by the socket's thread)
        self.version = 0
        self.staging = threading.Lock()
        self.staged: tuple[int, dict] | None = None  # the newest weights received (session, header and bytes), not loaded
        self.link = None  # the weight link of the current session (megarl/fleet/link.py)
        self.link_timeout_s = 60.0
        self.delay_s = float(os.environ.get(TEST_DELAY_ENV, "0") or 0)
        self.token_delay_s = float(os.environ.get(TEST_TOKEN_DELAY_ENV, "0") or 0)
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
        with self.staging:
            self.staged = None
        # async.partial_rollout (hf engines): weights that arrive during a request are loaded between
        # its tokens, each token recording the version that sampled it
        self.host.engine.between_tokens = self._between_tokens if header["partial_rollout"] else None
        # the engine is built: the link's thread joins the link now, so neither end waits long
        self.link_jobs.put(("join", header["transfer"], session))

    def _load(self, header, session) -> None:
        self._load_staged()

    def _between_tokens(self) -> None:
        if self.token_delay_s:
            time.sleep(self.token_delay_s)
        self._load_staged()

    def _load_staged(self) -> None:
        """The newest weights received and not loaded yet, if any (between requests, or between the
        tokens of one under async.partial_rollout); a version superseded before its turn is skipped."""
        with self.staging:
            staged, self.staged = self.staged, None
        if staged is None or staged[0] != self.session:
            return  # nothing new, or an earlier trainer's: its receive ended after this session began
        header = staged[1]
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
        with self.staging:
            self.staged = (session, {**header, "flat": flat})
        self.jobs.put(("load", None, session))  # loaded between two requests (or tokens), in the jobs' order


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
    rank, lockstep = server_world(tp, getattr(engine_maker, "cpu", True))
    if rank:  # the engine's other ranks: rank 0 alone talks to the trainer
        return follow(engine_maker, lockstep, lambda message: print(f"megarl serve {server_id} rank {rank}: {message}",
                                                                     flush=True))
    return serve(args.trainer, token, engine_maker, server_id, lockstep, tp)


if __name__ == "__main__":
    sys.exit(main())
