"""The training job's fleet endpoint (rollout.placement=fleet): a ZeroMQ ROUTER on rank 0 that rollout
servers join, leave and fail from while training goes on.

One thread owns the socket, so joins, heartbeats and losses are handled while the trainer trains:
it checks each hello's token before anything is sent, welcomes a server with the model config and
where its weight link meets (megarl/fleet/link.py: a gloo group of two, built for that server outside
the training world), answers heartbeats, and declares a server lost after rollout.fleet.heartbeat_s
of silence. Once the server has built its engine it says so ("link"), the link is built, and the
current weights go over it. The trainer's thread talks to the endpoint through `publish` (new weights
for every linked server: a header over ZeroMQ, the bytes over the links; a server whose link broke
is lost), `submit` (a batch of requests, a `Job`, split over the servers holding the newest weights
as soon as min_servers of them are there; a lost server's unfinished requests go to the others) and
`collect` (waits for a job's answers, saying every heartbeat_s why). `run` is both at once; under
async.max_staleness the trainer submits the steps ahead and collects each when it trains it.

A request is one prompt with its samples' seeds: a sample is a function of the weights, the
prompt and its seed, so a request finishes the same wherever it runs. A server answers a chunk of
requests in one result message; a chunk of a lost server is resubmitted whole, and its late
answer, should one come, is dropped: no sample mixes two servers.

The module is long because one thread owns the socket, and everything the socket's messages change
(the servers, their links, the jobs in flight and the counters) lives with it under one lock: split
over modules, that lock and its rules would be too.
"""
from __future__ import annotations

import datetime
import itertools
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import zmq

from megarl.fleet import link
from megarl.fleet.log import BackgroundLog
from megarl.fleet.mailbox import Mailbox
from megarl.fleet.wire import MAX_HEADER_BYTES, WireError, decode, encode, token_matches

# the longest the socket's thread sleeps between heartbeat checks (messages wake it at once: Mailbox)
POLL_MS = 100


@dataclass
class _Server:
    identity: bytes
    server_id: str
    last_seen: float
    offer: dict  # where its weight link meets (the welcome's transfer field)
    version: int = 0  # the weights version it has loaded (0: none yet)
    tokens_per_s: float | None = None
    linking: bool = False  # it said "link": its link is being built, or built (then `link`)
    link: Any = None  # its weight link (a two-rank gloo group) once built


@dataclass
class FleetStats:
    """The fleet's counters; `metrics` names them as the trainer logs them."""

    servers: int = 0
    lost_total: int = 0
    joined_total: int = 0
    resubmitted_total: int = 0
    refused_total: int = 0
    dropped_total: int = 0
    tokens_per_s: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        out = {"fleet/servers": float(self.servers), "fleet/lost_total": float(self.lost_total),
               "fleet/joined_total": float(self.joined_total), "fleet/resubmitted_total": float(self.resubmitted_total),
               "fleet/refused_total": float(self.refused_total), "fleet/dropped_total": float(self.dropped_total)}
        out.update({f"fleet/tokens_per_s/{sid}": v for sid, v in sorted(self.tokens_per_s.items())})
        return out


@dataclass(eq=False)
class Job:
    """One batch of requests handed to the fleet (a step's, validation's). Its samples are generated
    with weights `floor` or newer: the newest version when it was submitted, or a later one should a
    request be resubmitted after the trainer published another (fresher, never staler)."""

    step: int
    floor: int
    requests: list[dict]  # {prompt_index, prompt_ids, seeds}
    sampling: dict
    min_servers: int  # servers holding `floor` or newer before the first hand-out
    ids: dict[int, int]  # request id -> position in `requests`
    owner: dict[int, bytes] = field(default_factory=dict)  # request id -> the server it was sent to
    answers: dict[int, "Answer"] = field(default_factory=dict)
    handed_out: bool = False
    waiting_for: int = 0  # servers it waits for before it can hand out what is left (0: none)

    @property
    def done(self) -> bool:
        return len(self.answers) == len(self.ids)


class WaitStopped(Exception):
    """`run` gave up waiting for servers because `stop()` said so (a signal to the trainer)."""


@dataclass(frozen=True)
class Answer:
    """One request's samples as a server returned them (the wire's result.samples entries)."""

    request_id: int
    server_id: str
    version: int
    samples: list[dict]


class FleetEndpoint:
    """The ROUTER the servers join; `publish` and `run` are called from the trainer's thread."""

    def __init__(self, host: str, port: int, token: str, heartbeat_s: float, model_config: dict, dtype: str,
                 log: Callable[[str], None] = print, *, engine: str = "hf", tp: int = 1, max_model_len: int | None = None,
                 partial_rollout: bool = False):
        self.token, self.heartbeat_s = token, heartbeat_s
        self.log = BackgroundLog(log)  # a slow log write never holds up the socket's thread (megarl/fleet/log.py)
        self._model_config, self._dtype = model_config, dtype
        # the one engine the run's servers may run (rollout.engine) and its ranks (rollout.tp), and the
        # prompt + response tokens vLLM sizes its sequences by (None: the model's own limit), told in the welcome
        self.engine, self.tp, self._max_model_len = engine, tp, max_model_len
        self._partial_rollout = partial_rollout  # async.partial_rollout: servers load new weights between tokens
        # building a link and sending the weights over it: both ends are there when it starts, so
        # only a dead or cut-off server takes this long (and is then lost)
        self.link_timeout_s = max(60.0, 3 * heartbeat_s)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 1000)
        # messages are small (no weights: they go over the links); a peer sending more is cut off
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_HEADER_BYTES)
        try:
            self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as err:
            self._socket.close(0)
            self._context.term()
            raise ValueError(f"rollout.fleet: cannot open the fleet endpoint on {host}:{port} ({err}): choose a free "
                             f"rollout.fleet.port or an address of this node as rollout.fleet.host") from None
        self.address = f"{host}:{port}"
        self._links = link.LinkHost(host, self.link_timeout_s)
        self.stats = FleetStats()
        self._servers: dict[bytes, _Server] = {}
        self._strangers: set[bytes] = set()  # peers told off once: a lost server beats on until it rejoins
        self._weights: tuple[int, list[bytes], Any] | None = None  # (version, its message, its bytes)
        self._jobs: dict[int, Job] = {}  # request id -> its job, until collected
        self._outbox = Mailbox()  # (identity, frames) for the socket's thread, from any thread
        self._cond = threading.Condition()
        self._stop = threading.Event()
        # request ids start at a random point: a server's late answer to an earlier trainer of the run
        # (one killed and restarted) never matches a request of this one
        self._ids = itertools.count(secrets.randbits(48))
        self._thread = threading.Thread(target=self._loop, name="megarl-fleet", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the trainer's thread
    @property
    def version(self) -> int:
        return self._weights[0] if self._weights else 0

    def publish(self, version: int, named_tensors: Iterable) -> set[str]:
        """Weights `version` (HF names, full tensors) to every linked server, and to every later one
        when its link is built. Returns once the sends are issued: the servers receive and load
        while the trainer goes on (`run` waits for the servers that hold the version), and a server
        whose send fails is lost then. The names sent."""
        entries, flat = link.flatten(named_tensors)
        message = encode("weights", version=version, tensors=entries, bytes=flat.numel())
        with self._cond:
            self._weights = (version, message, flat)
            sends = [(server, self._send_weights(server)) for server in self._servers.values() if server.link]
        if sends:
            threading.Thread(target=self._await, args=(sends,), name="megarl-fleet-send", daemon=True).start()
        return {entry["name"] for entry in entries}

    def submit(self, step: int, requests: list[dict], sampling: dict, min_servers: int) -> Job:
        """A job of `requests` ({prompt_index, prompt_ids, seeds}) at the newest weights version, handed
        out at once if min_servers servers hold it, else as soon as they do (the socket's thread hands
        out and resubmits while the trainer trains). `collect` returns its answers."""
        with self._cond:
            job = Job(step, self.version, requests, sampling, min_servers,
                      {next(self._ids): i for i in range(len(requests))})
            self._jobs.update((rid, job) for rid in job.ids)
            self._advance(job)
        return job

    def collect(self, job: Job, stop: Callable[[], bool] = lambda: False) -> dict[int, Answer]:
        """Each of the job's requests' answer, by position in its `requests`. While it waits for
        servers it says so every heartbeat_s, and `stop()` true ends the wait with WaitStopped."""
        # the first line after heartbeat_s of waiting: a server loading the step's weights is not news
        said = time.monotonic()
        try:
            with self._cond:
                while True:
                    self._advance(job)
                    if job.done:
                        break
                    if job.waiting_for and stop():
                        raise WaitStopped(f"step {job.step} waited for rollout servers: {self._holding(job)} of "
                                          f"{job.waiting_for} held weights version {job.floor}")
                    if job.waiting_for and time.monotonic() - said >= self.heartbeat_s:
                        said = time.monotonic()
                        self.log(f"megarl fleet: step {job.step}: waiting for rollout servers: {self._holding(job)} of "
                                 f"{job.waiting_for} hold weights version {job.floor} ({len(self._servers)} joined; "
                                 f"{self._start_hint()})")
                    self._cond.wait(timeout=0.1)
                self.stats.servers = sum(1 for s in self._servers.values() if s.version == self.version)
                self.stats.tokens_per_s = {s.server_id: s.tokens_per_s for s in self._servers.values()
                                           if s.tokens_per_s is not None}
        finally:
            with self._cond:
                for rid in job.ids:
                    self._jobs.pop(rid, None)
        return {job.ids[rid]: answer for rid, answer in job.answers.items()}

    def run(self, step: int, requests: list[dict], sampling: dict, min_servers: int,
            stop: Callable[[], bool] = lambda: False) -> dict[int, Answer]:
        """`submit` and `collect` at once: a synchronous step's generation."""
        return self.collect(self.submit(step, requests, sampling, min_servers), stop)

    def close(self, farewell: bool = True) -> None:
        """Tell every server the run ended (`farewell`; without it they wait for a trainer that resumes
        the run), then close the socket."""
        with self._cond:
            for server in self._servers.values() if farewell else ():
                self._outbox.put((server.identity, encode("bye", reason="the run ended")))
        deadline = time.monotonic() + 2.0
        while not self._outbox.empty() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.log.close()

    def _start_hint(self) -> str:
        launcher = "python" if self.tp == 1 else f"torchrun --nproc_per_node {self.tp}"
        return (f"start one with `{launcher} -m megarl.rollout.serve --trainer {self.address} --token-file "
                f"<rollout.fleet.token_file> --engine {self.engine}`")

    def _holding(self, job: Job) -> int:
        return sum(1 for s in self._servers.values() if s.version >= job.floor)

    def _advance(self, job: Job) -> None:
        """(Under the lock.) The requests a lost server left unfinished are taken back; what is not
        handed out goes to the servers holding the job's weights, once min_servers of them are there
        for its first hand-out (a resubmission needs one)."""
        ready = [s for s in self._servers.values() if s.version >= job.floor]
        lost = [rid for rid, who in job.owner.items() if rid not in job.answers and who not in self._servers]
        for rid in lost:
            del job.owner[rid]
        self.stats.resubmitted_total += len(lost)
        todo = [rid for rid in job.ids if rid not in job.answers and rid not in job.owner]
        need = 1 if job.handed_out else job.min_servers
        job.waiting_for = need if todo and len(ready) < need else 0
        if todo and not job.waiting_for:
            self._hand_out(job, todo, ready)
            job.handed_out = True

    def _hand_out(self, job: Job, todo: list[int], ready: list[_Server]) -> None:
        """Contiguous chunks of `todo`, one per ready server (under the lock)."""
        per = -(-len(todo) // len(ready))
        for k, server in enumerate(ready):
            chunk = todo[k * per:(k + 1) * per]
            if not chunk:
                continue
            rows = [job.requests[job.ids[rid]] for rid in chunk]
            self._outbox.put((server.identity, encode(
                "request", step=job.step, version=job.floor, request_ids=chunk,
                prompt_index=[r["prompt_index"] for r in rows], prompt_ids=[list(r["prompt_ids"]) for r in rows],
                seeds=[list(r["seeds"]) for r in rows], sampling=job.sampling)))
            job.owner.update((rid, server.identity) for rid in chunk)

    def _take(self, identity: bytes, header: dict) -> None:
        """(Under the lock.) A result message: kept when it answers requests of one job that this
        server still owns, generated with the job's weights or newer."""
        server_id, rids = header["server_id"], header["request_ids"]
        job = self._jobs.get(rids[0]) if rids else None
        if job is None or header["version"] < job.floor or any(job.owner.get(rid) != identity for rid in rids):
            # a lost server's late answer, or one to a job collected already: its requests went elsewhere
            self.log(f"megarl fleet: dropped a result of server {server_id} (weights version {header['version']}, "
                     f"{len(rids)} requests it no longer holds)")
            return
        by_request: dict[int, list[dict]] = {rid: [] for rid in rids}
        for sample in header["samples"]:
            if sample["request_id"] not in by_request:
                self.log(f"megarl fleet: dropped a result of server {server_id}: sample of request "
                         f"{sample['request_id']}, which it was not asked")
                for rid in rids:
                    job.owner.pop(rid, None)  # resubmitted
                return
            by_request[sample["request_id"]].append(sample)
        for rid, samples in by_request.items():
            n = len(job.requests[job.ids[rid]]["seeds"])
            if sorted(s["sample_index"] for s in samples) != list(range(n)) or any(
                    len(s["token_ids"]) != len(s["logprobs"]) for s in samples):
                self.log(f"megarl fleet: dropped a result of server {server_id}: request {rid} does not have its {n} "
                         f"samples with one log-prob per token; resubmitting its requests")
                for r in rids:
                    job.owner.pop(r, None)
                return
        for rid, samples in by_request.items():
            job.answers[rid] = Answer(rid, server_id, header["version"], samples)

    # ------------------------------------------------------------ the socket's thread
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._outbox.fileno(), zmq.POLLIN)
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                for identity, frames in self._outbox.take_all():
                    self._socket.send_multipart([identity, *frames], copy=False)
                if self._socket in dict(poller.poll(POLL_MS)):
                    while True:
                        try:
                            identity, *frames = self._socket.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._receive(identity, frames)
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.heartbeat_s / 3
                    self._beat(now)
                with self._cond:  # jobs submitted ahead go out, and are resubmitted, while the trainer trains
                    for job in {id(job): job for job in self._jobs.values()}.values():
                        self._advance(job)
        finally:
            self._socket.close(linger=1000)
            self._context.term()
            self._outbox.close()

    def _receive(self, identity: bytes, frames: list[bytes]) -> None:
        with self._cond:
            server = self._servers.get(identity)
            who = f"server {server.server_id}" if server else "a peer that has not joined"
            try:
                header = decode(frames)
            except WireError as err:
                self.stats.dropped_total += 1
                self.log(f"megarl fleet: dropped a malformed message from {who}: {err}")
                return
            kind = header["type"]
            if kind == "hello":
                self._hello(identity, header)
                return
            if server is None:
                self.stats.dropped_total += 1
                if identity not in self._strangers:  # one line per peer, not one per heartbeat
                    self._strangers.add(identity)
                    self.log(f"megarl fleet: dropped a {kind} message from {who} (a server says hello with the run's "
                             f"token first; a lost server joins again when it notices; further messages of this peer "
                             f"are dropped without a line)")
                return
            server.last_seen = time.monotonic()
            if kind == "ready":
                server.version = header["version"]
            elif kind == "link":
                if header["prefix"] != server.offer["prefix"] or server.linking:
                    self.stats.dropped_total += 1
                    self.log(f"megarl fleet: dropped a link message from {who}: not the link it was offered")
                    return
                server.linking = True
                threading.Thread(target=self._accept, args=(server,), name="megarl-fleet-link", daemon=True).start()
            elif kind == "result":
                if header["tokens_per_s"] > 0:
                    server.tokens_per_s = float(header["tokens_per_s"])
                self._take(identity, {**header, "server_id": server.server_id})
            elif kind == "bye":
                del self._servers[identity]
                self.log(f"megarl fleet: server {server.server_id} left ({header['reason']}); {len(self._servers)} joined")
            elif kind != "heartbeat":
                self.stats.dropped_total += 1
                self.log(f"megarl fleet: dropped a {kind} message from {who}: servers do not send it")
                return
            self._cond.notify_all()

    def _hello(self, identity: bytes, header: dict) -> None:
        """The token first; a server that cannot show it gets nothing but the refusal."""
        if not token_matches(header["token"], self.token):
            self._refuse(identity, header, "wrong token", "wrong token: use the run's rollout.fleet.token_file")
            return
        if header["engine"] != self.engine:
            # one engine per run: hf and vLLM sample differently from one seed (a resubmission must not change a sample)
            self._refuse(identity, header, f"engine {header['engine']!r}, but this run's rollout.engine is {self.engine}",
                         f"engine {header['engine']!r}: this run's servers run rollout.engine={self.engine}: start them "
                         f"with --engine {self.engine}")
            return
        if header["tp"] != self.tp:
            # vLLM at another tensor-parallel size reduces in another order: a resubmitted request could change
            self._refuse(identity, header, f"{header['tp']} ranks, but this run's rollout.tp is {self.tp}",
                         f"{header['tp']} ranks: this run's servers run rollout.tp={self.tp}: {self._start_hint()}")
            return
        offer = self._links.offer()  # a new link for every join: a server that joins again gets a new one
        self._servers[identity] = _Server(identity, header["server_id"], time.monotonic(), offer)
        self.stats.joined_total += 1
        self.log(f"megarl fleet: server {header['server_id']} joined; {len(self._servers)} joined")
        self._outbox.put((identity, encode("welcome", model_config=self._model_config, dtype=self._dtype,
                                           max_model_len=self._max_model_len, heartbeat_s=self.heartbeat_s, transfer=offer,
                                           partial_rollout=self._partial_rollout)))

    def _refuse(self, identity: bytes, header: dict, why: str, reason: str) -> None:
        """A hello refused: counted, one log line (`why`), and the refusal (`reason`) the only reply."""
        self.stats.refused_total += 1
        self.log(f"megarl fleet: refused server {header['server_id']!r}: {why}")
        self._outbox.put((identity, encode("refused", reason=reason)))

    def _beat(self, now: float) -> None:
        """Heartbeats out; servers silent for heartbeat_s are lost. A server still joining (welcomed,
        no weights loaded yet) has link_timeout_s: building an engine can hold a server's
        interpreter for seconds (imports, a model's construction), and in a CI run under heavy disk
        writes a joining server fell silent for 3.8 s, was lost, and stalled its next join for a
        minute; it holds no requests, so a longer grace costs nothing."""
        with self._cond:
            for server in list(self._servers.values()):
                if now - server.last_seen > (self.heartbeat_s if server.version else self.link_timeout_s):
                    self._lose(server, f"silent for {now - server.last_seen:.1f} s")
                else:
                    self._outbox.put((server.identity, encode("heartbeat", version=self.version)))

    def _lose(self, server: _Server, why: str) -> None:
        """`server` is lost (under the lock; nothing when it left already): its unfinished requests go to
        the others at run's next look."""
        if self._servers.get(server.identity) is not server:
            return
        del self._servers[server.identity]
        self.stats.lost_total += 1
        self.log(f"megarl fleet: lost server {server.server_id} ({why}); {len(self._servers)} left, its unfinished "
                 f"requests go to the others")
        self._cond.notify_all()

    # ------------------------------------------------------------ the weight links
    def _accept(self, server: _Server) -> None:
        """(A thread of its own, per link.) The link of a server that built its engine, and then the
        current weights over it."""
        try:
            group = self._links.accept(server.offer)
        except Exception as err:  # the server died or was cut off while building its side
            with self._cond:
                self._lose(server, f"its weight link could not be built: {_first_line(err)}")
            return
        with self._cond:
            if self._servers.get(server.identity) is not server:
                return  # lost meanwhile
            server.link = group
            sends = [(server, self._send_weights(server))] if self._weights is not None else []
        self.log(f"megarl fleet: weight link to server {server.server_id} built")
        self._await(sends)

    def _send_weights(self, server: _Server):
        """The current weights' header over ZeroMQ and their bytes over the server's link (under the
        lock, so that every link sees the versions in order); the send's work."""
        _, message, flat = self._weights
        self._outbox.put((server.identity, message))
        return link.send(server.link, flat)

    def _await(self, sends: list) -> None:
        """Each send finished; a server whose link broke (dead, or cut off for link_timeout_s) is lost."""
        for server, work in sends:
            try:
                work.wait(datetime.timedelta(seconds=self.link_timeout_s))
            except Exception as err:
                with self._cond:
                    self._lose(server, f"its weight link broke: {_first_line(err)}")


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
