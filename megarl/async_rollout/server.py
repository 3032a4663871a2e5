"""The rollout rank's program under rollout.placement=separate.

Two threads, each on a process group of its own (megarl.async_rollout.placement.WorldGroups), so they never
interleave operations on one group:
- the receiving thread reads commands from the training ranks on `ctrl`: "weights" (then the
  weight stream, on `down` of the shared reshard plan, megarl.hybrid, into a staging copy: this rank's
  rollout shard and nothing else), "generate" (queued), "stop";
- the main thread takes queued requests in order; before each it loads the newest staged weights
  (between requests), and with async.partial_rollout also between the tokens of a running request
  (the engine's `between_tokens` hook: tokens, log-probs and KV cache are kept, each token records
  the version it was sampled under). Results go back to the requesting training rank on `up`.

A request carries `floor`, the weights version it must be generated with at least: the trainer
sends the weights before the prompts that need them, but prompts from another training rank may
overtake rank 0's "weights" command, so the floor, not arrival order, decides.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from megarl.async_rollout.engine_side import build_engine
from megarl.async_rollout.wire import recv_object, send_object
from megarl.config.validation import layout_of
from megarl.data.tokenizer import load_tokenizer
from megarl.hybrid.engine import HybridEngine
from megarl.platform import current_platform
from megarl.runtime import heartbeat
from megarl.rollout.base import RolloutRequest, SamplingParams
from megarl.rollout.multi_turn import with_environment


@dataclass
class GenerateRequest:
    client: int
    request_id: int
    requests: list[RolloutRequest]
    sampling: SamplingParams
    floor: int
    rows: dict | None = None  # rollout.multi_turn: {prompt index: row}, the episodes' resets


class RolloutServer:
    """Serves generation for its client training ranks until "stop"."""

    def __init__(self, engine, hybrid, groups, rank: int, partial_rollout: bool, log=print,
                 engine_ranks: tuple[int, ...] | None = None, episodes=None):
        """engine_ranks: the global ranks of this rank's engine instance (rollout.tp > 1: vLLM's TP
        group, which runs in lockstep); the first one leads, the others follow it.
        episodes: rollout.multi_turn's MultiTurnRollout over `engine` (None without), which runs
        the requests that carry prompt rows; weights and versions stay with `engine`."""
        self.engine, self.hybrid, self.groups, self.rank, self.log = engine, hybrid, groups, rank, log
        self.engine_ranks = tuple(engine_ranks or (rank,))
        self.leader = self.engine_ranks[0]
        self.episodes = episodes
        self.queue: queue.Queue = queue.Queue()
        self.cond = threading.Condition()
        self.staged: tuple[int, dict[str, torch.Tensor]] | None = None
        # a follower loads exactly the version its leader loaded, so it keeps every version staged
        # until then (a newer stream may land here before it lands on the leader)
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        engine.version = -1  # no weights from the trainer yet: every request waits for the first stream
        self.staged_version = -1
        self.sync_bytes = 0  # bytes of the last weight stream received by this rank (chunks padded to 8 bytes)
        self.sync_payload_bytes = 0  # the same without the padding: its rollout shard
        self.sync_full_bytes = 0  # what a full stream brings this rank (rollout.weight_sync.mode=delta sends less)
        self.sync_changed_fraction = 1.0  # of the elements received, the share that changed (1: a full stream)
        self.busy_s = 0.0
        self.started = time.perf_counter()
        self.error: BaseException | None = None
        if partial_rollout:
            engine.between_tokens = self.load_staged
        plan = hybrid.plan
        # separate placement: this rank holds nothing, so it receives exactly its rollout shard
        assert plan.planned_recv_bytes[rank] == plan.needed_bytes[rank] == plan.min_recv_bytes[rank], (
            plan.planned_recv_bytes[rank], plan.needed_bytes[rank])

    # --- receiving thread -------------------------------------------------------------------------
    def _receive(self) -> None:
        try:
            while True:
                message = recv_object(None, self.groups.ctrl)
                kind = message[0]
                if kind == "weights":
                    version = message[1]
                    staged = {name: t.detach().clone() for name, t in self.hybrid.stream()}
                    self.sync_bytes = self.hybrid.last_stats.bytes_received
                    self.sync_payload_bytes = self.hybrid.last_stats.payload_received
                    self.sync_full_bytes = self.hybrid.last_stats.full_bytes_received
                    self.sync_changed_fraction = self.hybrid.last_stats.changed_fraction
                    with self.cond:
                        if self.rank == self.leader:
                            self.staged = (version, staged)
                        else:
                            self.pending[version] = staged
                        self.staged_version = version
                        self.cond.notify_all()
                elif kind == "generate":
                    self.queue.put(GenerateRequest(*message[1:]))
                elif kind == "stop":
                    self.queue.put(None)
                    return
                else:
                    raise ValueError(f"rollout rank {self.rank}: unknown command {kind!r}")
        except BaseException as err:  # surfaced by the main thread
            self.error = err
            self.queue.put(None)

    # --- main thread ------------------------------------------------------------------------------
    def load_staged(self) -> None:
        """Load the newest staged weights into the engine, if any arrived (between requests or tokens)."""
        with self.cond:
            staged, self.staged = self.staged, None
        if staged is not None:
            version, tensors = staged
            self.engine.load_weights(tensors.items())
            self.engine.version = version

    def _wait_for(self, floor: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.staged_version >= floor or self.error is not None)
        self.load_staged()

    def _load_exact(self, version: int) -> None:
        """A follower: the weights of `version` (what the leader generates with), older ones dropped."""
        if self.engine.version == version:
            return
        with self.cond:
            self.cond.wait_for(lambda: version in self.pending or self.error is not None)
            tensors = self.pending.pop(version, None)
            for v in [v for v in self.pending if v < version]:
                del self.pending[v]
        if tensors is not None:
            self.engine.load_weights(tensors.items())
            self.engine.version = version

    def _follow(self) -> None:
        """A follower's loop: the leader's requests, in its order, under its weights version; the
        results stay here (the leader returns its own, the same: one engine)."""
        while self.error is None:
            item = recv_object(self.leader, self.groups.up)
            if item is None:
                break
            version, requests, sampling = item
            self._load_exact(version)
            if self.error is not None:
                break
            heartbeat.enter("generate")
            start = time.perf_counter()
            self.engine.generate(requests, sampling)
            self.busy_s += time.perf_counter() - start
            heartbeat.enter("wait")

    def serve(self) -> None:
        receiver = threading.Thread(target=self._receive, name="megarl-rollout-recv", daemon=True)
        receiver.start()
        if self.rank != self.leader:
            self._follow()
            receiver.join(timeout=5)
            if self.error is not None:
                raise RuntimeError(f"rollout rank {self.rank}: {self.error}") from self.error
            return
        while True:
            heartbeat.enter("wait")
            item = self.queue.get()
            if item is None:
                break
            self._wait_for(item.floor)
            if self.error is not None:
                break
            for follower in self.engine_ranks[1:]:  # the same call on every rank of the engine
                send_object((self.engine.version, item.requests, item.sampling), follower, self.groups.up)
            heartbeat.enter("generate")
            start = time.perf_counter()
            engine = self.engine
            if item.rows is not None and self.episodes is not None:
                engine, self.episodes.rows = self.episodes, item.rows
            results = engine.generate(item.requests, item.sampling) if item.requests else []
            for res in results:  # an engine that loads weights between requests only: one version per request
                if res.versions is None:
                    res.versions = [self.engine.version] * len(res.response_token_ids)
            self.busy_s += time.perf_counter() - start
            info = {"sync_bytes": self.sync_bytes, "sync_full_bytes": self.sync_full_bytes,
                    "sync_changed_fraction": self.sync_changed_fraction, "shard_bytes": self.hybrid.plan.needed_bytes[self.rank], "busy_s": self.busy_s, "wall_s": time.perf_counter() - self.started,
                    "rank": self.rank}
            send_object(("result", item.request_id, results, info), item.client, self.groups.up)
        for follower in self.engine_ranks[1:]:
            send_object(None, follower, self.groups.up)
        receiver.join(timeout=5)
        if self.error is not None:
            raise RuntimeError(f"rollout rank {self.rank}: {self.error}") from self.error


def make_server(cfg, groups, rank: int, log=print) -> RolloutServer:
    """A rollout rank's engine (built with the other rollout ranks, megarl.async_rollout.engine_side)
    and the shared reshard plan into the layout it loads (a collective with the training ranks)."""
    placement = groups.placement
    setup = build_engine(cfg, groups, rank)
    hybrid = HybridEngine({}, train=layout_of(cfg.parallel, placement.train_size), rollout=setup.weight_layout,
                          bucket_bytes=cfg.rollout.bucket_bytes, separate=groups, device=current_platform().device,
                          mode=cfg.rollout.weight_sync.mode, full_every=cfg.rollout.weight_sync.full_every)
    hybrid.convert = setup.convert
    episodes = None
    if cfg.rollout.multi_turn.environment is not None:  # the episodes run here, beside the engine (megarl.rollout.multi_turn)
        episodes = with_environment(setup.engine, cfg.rollout, load_tokenizer(cfg.model.path),
                                    log=log if rank == placement.train_size else None)
    return RolloutServer(setup.engine, hybrid, groups, rank, cfg.async_.partial_rollout, log=log,
                         engine_ranks=setup.groups.ranks, episodes=episodes)


def run_rollout_rank(cfg, groups, rank: int, log=print) -> int:
    """A rollout rank's whole life: its engine and the shared reshard plan (make_server: waits for
    the training ranks, whose rank 0 prepares the model directory first), serving until "stop"."""
    placement = groups.placement
    server = make_server(cfg, groups, rank, log=log)
    beat = heartbeat.start_for_world(cfg.trainer.collective_timeout_s, rank, placement.world_size, separate=groups)
    try:
        server.serve()
    finally:
        beat.stop()
        server.engine.close()
    return 0
