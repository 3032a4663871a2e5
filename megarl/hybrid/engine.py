"""HybridEngine: the actor's weights, from the training layout into a colocated rollout engine.

Setup (once, collective over the default process group): every rank all-gathers the metadata of
its `local_shards` (names, shapes, dtypes, ShardMeta), all ranks compute the same plan
(`plan.make_plan`), and the process groups the plan broadcasts on are created. Each sync then
streams this rank's rollout shard of every tensor, bucket by bucket, through `convert` into the
engine's `load_weights`. The tensors in `local_shards` are read at sync time, so they may be
the live parameters.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from megarl.layout import ParallelLayout, RolloutLayout, assign_rollout, hybridflow_bytes_per_rank, separate_assignment
from megarl.hybrid.delta import SegmentCopies
from megarl.hybrid.plan import Plan, build_specs, make_plan
from megarl.hybrid.transfer import Converter, MemoryMeter, PlanRunner, TransferStats, identity_convert
from megarl.models.sharding import ShardMeta

LocalShards = Mapping[str, tuple[torch.Tensor, ShardMeta]]


@dataclass
class SyncStats:
    """What one sync cost on this rank (bytes exact, memory instrumented, seconds wall)."""

    bytes_received: int
    bytes_sent: int
    collectives: int
    peak_extra_bytes: int
    seconds: float
    cuda_peak_extra_bytes: int | None = None
    payload_received: int = 0  # bytes_received less the alignment padding of its chunks
    full_bytes_received: int = 0  # what a full sync receives: the bound bytes_received is measured against
    changed_fraction: float = 1.0  # of the elements this rank received, the share that changed since the last sync (1: full sync)
    full: bool = True  # this sync sent every segment in full (mode full, the first sync, every full_every-th)
    copy_bytes: int = 0  # delta sync: what this rank keeps of the last sync (rollout dtype, on the sync device)


def streamed_shards(local_shards: LocalShards, tie_embeddings: bool) -> LocalShards:
    """The actor's shards the rollout engine needs. With tied embeddings under pp > 1 the last
    stage holds a copy of the embedding as its output layer: the engine needs it once."""
    if tie_embeddings:
        local_shards.pop("output_layer.weight", None)
    return local_shards


def shard_metadata(local_shards: LocalShards) -> list[tuple]:
    """This rank's metadata row for `build_specs` (picklable, no tensors)."""
    rows = []
    for name, (t, meta) in local_shards.items():
        if not isinstance(meta, ShardMeta):
            raise ValueError(f"local_shards[{name!r}] must be (tensor, ShardMeta), got {type(meta).__name__}")
        rows.append((name, tuple(meta.full_shape), str(t.dtype), meta.tp_dim, meta.tp_rank, meta.tp_size, meta.tp_sub_chunks, tuple(t.shape)))
    return rows


class HybridEngine:
    """Reshards the actor from `train` to `rollout` layout; see docs/rollout.md for the decisions.

    local_shards: this rank's parameters under global names with their ShardMeta.
    convert: canonical tensor in `rollout`'s layout (full at tp 1, else this rank's rollout shard,
        `rollout.rows` where the engine splits unevenly) -> [(engine name, tensor)]: what
        `megarl.rollout.build_rollout` returns as `RolloutSetup.convert`. Identity by default.
    bucket_bytes: the most bytes one bucket stages on a rank (send + receive).
    separate: the world split of separate placement (megarl.async_rollout.placement.WorldGroups): the rollout
        ranks, which hold no training shard (empty local_shards), load the stream; the same plan,
        point to point over `separate.down`. Collective over the whole world then.
    mode: rollout.weight_sync.mode: "full" sends every rollout shard whole at every sync; "delta"
        sends, after a full sync, only the elements that changed (megarl.hybrid.delta), with a full
        sync every `full_every` syncs and after `resync_full()`. Every rank of the stream must use
        the same mode and full_every (the trainer's and the rollout ranks' engines read one config).
    """

    def __init__(self, local_shards: LocalShards, *, train: ParallelLayout, rollout: RolloutLayout = RolloutLayout(),  # noqa: B008 (frozen)
                 bucket_bytes: int = 512 << 20, convert: Converter | None = None, device: torch.device | str | None = None,
                 separate=None, mode: str = "full", full_every: int = 50):
        if mode not in ("full", "delta"):
            raise ValueError(f"rollout.weight_sync.mode must be 'full' or 'delta', got {mode!r}")
        if full_every < 1:
            raise ValueError(f"rollout.weight_sync.full_every must be >= 1, got {full_every}")
        self.mode, self.full_every = mode, full_every
        self._copies = SegmentCopies() if mode == "delta" else None
        self._syncs_since_full: int | None = None  # None: the next sync is full
        if not dist.is_initialized():
            raise ValueError("HybridEngine needs torch.distributed initialised (gloo on CPU, nccl on GPU)")
        if separate is None and dist.get_world_size() != train.world_size:
            raise ValueError(f"world size {dist.get_world_size()} != {train.describe()}")
        self.rank = dist.get_rank(group=separate.down) if separate is not None else dist.get_rank()
        self.train, self.rollout = train, rollout
        self.convert = convert or identity_convert
        first = next(iter(local_shards.values()), None)
        self.device = torch.device(device) if device is not None else (first[0].device if first else torch.device("cpu"))
        self.local_shards = local_shards
        if separate is None:
            gathered: list = [None] * train.world_size
            dist.all_gather_object(gathered, shard_metadata(local_shards))  # once; the plan is cached
            self.assignment, receivers = assign_rollout(train, rollout), None
        else:
            placement = separate.placement
            gathered = [None] * placement.world_size
            dist.all_gather_object(gathered, shard_metadata(local_shards), group=separate.down)
            receivers = placement.rollout_ranks
            self.assignment = separate_assignment(placement.train_size, receivers, rollout.tp)
        self.plan: Plan = make_plan(build_specs(gathered), train, self.assignment, rollout.tp, bucket_bytes, dict(rollout.rows),
                                    receivers=receivers)
        # every rank creates every group, in the same order (new_group is collective)
        needed = sorted({op.group for b in self.plan.buckets for op in b.ops if op.group is not None})
        self._groups = {g: dist.new_group(list(g)) for g in needed}
        self._runner = PlanRunner(self.plan, self.rank, self._groups, self.device, all_gather_as_broadcasts=dist.get_backend() == "gloo",
                                  p2p_group=None if separate is None else separate.down, copies=self._copies)
        self.last_stats: SyncStats | None = None

    # ---------------------------------------------------------------- layout facts
    @property
    def rollout_tp_rank(self) -> int:
        return self.assignment.rollout_tp_rank[self.rank]

    @property
    def rollout_group_ranks(self) -> tuple[int, ...]:
        """The ranks whose rollout shards together make this rank's engine instance."""
        return self.assignment.group_of(self.rank)

    def lower_bound_bytes(self) -> dict[str, float]:
        """HybridFlow's formula and the exact per-rank minimum for this plan's grouping."""
        return {
            "hybridflow_bytes_per_rank": hybridflow_bytes_per_rank(self.plan.model_bytes, self.train, self.rollout.tp),
            "exact_min_bytes_per_rank_max": max(self.plan.min_recv_bytes),
            "planned_bytes_per_rank_max": max(self.plan.planned_recv_bytes),
        }

    def delta_copy_bytes(self) -> int:
        """Bytes this rank keeps between syncs under delta sync (0 under full): a copy of every
        segment it sends or receives, i.e. its bucket buffers of all buckets together."""
        if self.mode != "delta":
            return 0
        return sum(op.nbytes for b in self.plan.buckets for op in b.ops if self.rank in op.participants)

    def resync_full(self) -> None:
        """The next sync sends everything in full and forgets the copies (an engine or a peer that
        lost what it held). Collective in effect: every rank of the stream must call it together."""
        self._syncs_since_full = None
        if self._copies is not None:
            self._copies.clear()

    def _next_is_full(self) -> bool:
        return self.mode == "full" or self._syncs_since_full is None or self._syncs_since_full + 1 >= self.full_every

    # ---------------------------------------------------------------- sync
    def stream(self, local_shards: LocalShards | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield this rank's (engine name, tensor) stream; a collective: every rank must drain it.

        Sets `last_stats` when exhausted. Tensors are valid until the next item is requested.
        """
        shards = self.local_shards if local_shards is None else local_shards
        if local_shards is not None and shard_metadata(local_shards) != shard_metadata(self.local_shards):
            raise ValueError("local_shards changed names/shapes/metadata since the plan was built; build a new HybridEngine")
        local = {name: t.detach() for name, (t, _) in shards.items()}
        meter, stats = MemoryMeter(), TransferStats()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        full = self._next_is_full()
        yield from self._runner.run(local, self.convert, meter, stats, full=full)
        self._syncs_since_full = 0 if full else self._syncs_since_full + 1
        cuda_peak = None
        if cuda:
            torch.cuda.synchronize(self.device)
            cuda_peak = torch.cuda.max_memory_allocated(self.device) - base
        changed = stats.changed_received / stats.elements_received if stats.elements_received else (1.0 if full else 0.0)
        self.last_stats = SyncStats(stats.bytes_received, stats.bytes_sent, stats.collectives, meter.peak, stats.seconds, cuda_peak,
                                   stats.payload_received, full_bytes_received=stats.full_bytes_received,
                                   changed_fraction=changed, full=full, copy_bytes=self._copies.nbytes if self._copies else 0)

    def sync(self, engine, local_shards: LocalShards | None = None) -> SyncStats:
        """Load the current weights into `engine` and bring its KV cache back; returns the cost."""
        engine.load_weights(self.stream(local_shards))
        engine.resume_memory()
        return dataclasses.replace(self.last_stats)

    def hand_over(self, engine, offload: Callable[[], None], local_shards: LocalShards | None = None) -> SyncStats:
        """The trainer's switch to rollout: load the weights (they are read from the training
        parameters, so before those leave), `offload` the training state, return PyTorch's cached
        blocks to the device, and only then wake the engine's KV cache, so the KV cache can use the
        memory training held (otherwise it stays in PyTorch's caching allocator, invisible to vLLM
        and SGLang)."""
        engine.load_weights(self.stream(local_shards))
        offload()
        release_cached_device_memory()
        engine.resume_memory()
        return dataclasses.replace(self.last_stats)


def release_cached_device_memory() -> None:
    """torch.cuda.empty_cache() where CUDA is in use (a no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
