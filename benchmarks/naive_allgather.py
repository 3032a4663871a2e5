"""The baseline megarl is measured against: what verl's Megatron path does today.

For every tensor, one at a time and unbucketed: the owning pipeline stage broadcasts its TP
shard over the PP group, then the TP group all-gathers the full tensor; every rank ends up with
every full tensor (verl `per_tensor_generator`). Only for benchmarks; dense models only.
"""
from __future__ import annotations

import time
from typing import Iterator

import torch
import torch.distributed as dist

from megarl.hybrid.engine import LocalShards, SyncStats, shard_metadata
from megarl.hybrid.layout import TrainLayout
from megarl.hybrid.plan import build_specs, natural_key
from megarl.hybrid.transfer import Converter, MemoryMeter, TransferStats, identity_convert
from megarl.models.sharding import ShardMeta


class NaiveAllGather:
    """Per-tensor PP broadcast + TP all-gather; construct on every rank (collective)."""

    def __init__(self, local_shards: LocalShards, *, train: TrainLayout, convert: Converter | None = None, device=None):
        self.rank, self.train = dist.get_rank(), train
        self.convert = convert or identity_convert
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.local_shards = local_shards
        gathered: list = [None] * train.world_size
        dist.all_gather_object(gathered, shard_metadata(local_shards))
        self.specs = build_specs(gathered)
        self.order = sorted(self.specs, key=natural_key)
        self.stage = {}
        for name, s in self.specs.items():
            stages = {train.coords(h).pp for h, _ in s.holders}
            if len({train.coords(h).dp for h, _ in s.holders}) != train.dp:
                raise ValueError(f"{name} is not held in every DP replica (expert parallel?): the naive baseline supports dense models only")
            self.stage[name] = min(stages)
        c = train.coords(self.rank)
        self.coords = c
        self.tp_groups = {}
        self.pp_groups = {}
        for d in range(train.dp):  # every rank creates every group, in the same order
            for p in range(train.pp):
                self.tp_groups[(p, d)] = dist.new_group([train.rank_of(p, j, d) for j in range(train.tp)])
            for j in range(train.tp):
                self.pp_groups[(j, d)] = dist.new_group([train.rank_of(p, j, d) for p in range(train.pp)])
        self.last_stats: SyncStats | None = None

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        c, train = self.coords, self.train
        meter, stats = MemoryMeter(), TransferStats()
        t0 = time.perf_counter()
        for name in self.order:
            s = self.specs[name]
            split = s.tp_dim is not None and s.tp_size > 1
            meta = ShardMeta(s.full_shape, s.tp_dim, c.tp, s.tp_size, s.sub_chunks)
            shard_shape = s.full_shape if not split else tuple(d // s.tp_size if i == s.tp_dim else d for i, d in enumerate(s.full_shape))
            owner = self.stage[name]
            if c.pp == owner:
                shard = self.local_shards[name][0].detach()
            else:
                shard = meter.empty(shard_shape, s.dtype, self.device)
            if train.pp > 1:
                dist.broadcast(shard, src=train.rank_of(owner, c.tp, c.dp), group=self.pp_groups[(c.tp, c.dp)])
                stats.collectives += 1
                if c.pp != owner:
                    stats.bytes_received += shard.numel() * shard.element_size()
            if split:
                parts = [meter.empty(shard_shape, s.dtype, self.device) for _ in range(s.tp_size)]
                dist.all_gather(parts, shard.contiguous(), group=self.tp_groups[(c.pp, c.dp)])
                stats.collectives += 1
                stats.bytes_received += (s.tp_size - 1) * shard.numel() * shard.element_size()
                full = meta.full_from_shards(parts)
                meter.track(full)
                for p in parts:
                    meter.free(p)
            else:
                full = shard
            for item in self.convert(name, full):
                yield item
            meter.free(full)
            if shard is not full:
                meter.free(shard)
        stats.seconds = time.perf_counter() - t0
        self.last_stats = SyncStats(stats.bytes_received, stats.bytes_sent, stats.collectives, meter.peak, stats.seconds)
