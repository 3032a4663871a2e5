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
    separate: the world split of separate placement (megarl.placement.WorldGroups): the rollout
        ranks, which hold no training shard (empty local_shards), load the stream; the same plan,
        point to point over `separate.down`. Collective over the whole world then.
    """

    def __init__(self, local_shards: LocalShards, *, train: ParallelLayout, rollout: RolloutLayout = RolloutLayout(),
                 bucket_bytes: int = 512 << 20, convert: Converter | None = None, device: torch.device | str | None = None,
                 separate=None):
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
                                  p2p_group=None if separate is None else separate.down)
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
        yield from self._runner.run(local, self.convert, meter, stats)
        cuda_peak = None
        if cuda:
            torch.cuda.synchronize(self.device)
            cuda_peak = torch.cuda.max_memory_allocated(self.device) - base
        self.last_stats = SyncStats(stats.bytes_received, stats.bytes_sent, stats.collectives, meter.peak, stats.seconds, cuda_peak,
                                   stats.payload_received)

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
