"""Runs a reshard plan on one rank: instrumented collectives, bucket buffers, shard assembly.

Memory: per bucket one byte buffer holds everything this rank sends or receives in it (at most
bucket_bytes by construction of the plan); rollout shards are then assembled one tensor at a
time, converted, yielded and dropped. Peak extra memory is therefore one bucket plus one tensor
(plus whatever new tensors the converter allocates), which `MemoryMeter` measures.

Bytes: `TransferStats.bytes_received` counts what crosses the wire into this rank (a rank's own
segment of an all-gather is not counted; alignment padding, at most 7 bytes per chunk, is).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megarl import profiling
from megarl.hybrid.plan import Chunk, Op, Plan, Span, TensorSpec

Converter = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]


# torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single; GPU users may run older torch.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def identity_convert(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor)]


@dataclass
class TransferStats:
    bytes_received: int = 0  # on the wire: chunks padded to ALIGN
    bytes_sent: int = 0
    collectives: int = 0
    seconds: float = 0.0
    payload_received: int = 0  # the chunks' own bytes in what was received (no padding)


@dataclass
class MemoryMeter:
    """Bytes of temporary buffers alive at once (instrumented accounting; device independent)."""

    current: int = 0
    peak: int = 0
    _live: dict[int, int] = field(default_factory=dict)

    def empty(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=device)
        self.track(t)
        return t

    def track(self, t: torch.Tensor) -> None:
        key = t.untyped_storage().data_ptr()
        if key in self._live or t.numel() == 0:
            return
        n = t.untyped_storage().nbytes()
        self._live[key] = n
        self.current += n
        self.peak = max(self.peak, self.current)

    def free(self, t: torch.Tensor) -> None:
        self.current -= self._live.pop(t.untyped_storage().data_ptr(), 0)


def region_views(t: torch.Tensor, spec: TensorSpec, base: Span, piece: Span, rows: tuple[int, int] | None, L: int) -> list[torch.Tensor]:
    """Views of `t` (which holds span `base` of every sub-chunk block) covering span `piece`."""
    if spec.tp_dim is None:
        views = [t]
    else:
        block = t.shape[spec.tp_dim] // spec.sub_chunks
        unit = block // (base.hi - base.lo)
        start, length = (piece.lo - base.lo) * unit, (piece.hi - piece.lo) * unit
        views = [t.narrow(spec.tp_dim, b * block + start, length) for b in range(spec.sub_chunks)]
    if rows is not None:
        views = [v.narrow(spec.split_dim, rows[0], rows[1] - rows[0]) for v in views]
    return views


def _chunk_views(buf: torch.Tensor, offset: int, chunk: Chunk, spec: TensorSpec, L: int) -> list[torch.Tensor]:
    """The chunk's bytes in `buf` as tensors shaped like its region views (same order)."""
    flat = buf[offset:offset + chunk.nbytes].view(spec.dtype)
    shape = list(spec.span_shape(Span(0, chunk.span.hi - chunk.span.lo), L, chunk.rows))
    if spec.tp_dim is not None:
        shape[spec.tp_dim] //= spec.sub_chunks
    n = 1
    for d in shape:
        n *= d
    return [flat[b * n:(b + 1) * n].view(shape) for b in range(spec.sub_chunks if spec.tp_dim is not None else 1)]


class PlanRunner:
    """Executes `plan` on `rank`, yielding (name, tensor) of its rollout shard, tensor by tensor."""

    def __init__(self, plan: Plan, rank: int, groups: dict[tuple[int, ...], object], device: torch.device,
                 all_gather_as_broadcasts: bool = False, p2p_group=None):
        self.plan, self.rank, self.groups, self.device = plan, rank, groups, device
        # separate placement: point-to-point ops cross from training to rollout ranks on a group
        # over the whole world (the training ranks' default group holds only them)
        self.p2p_group = p2p_group
        # gloo's all_gather_single copies through a private flat buffer and was ~2x slower than one
        # broadcast per member when the input lives inside the output (measured, 4 ranks, 16 MiB);
        # NCCL's in-place all-gather is the fast path there.
        self.all_gather_as_broadcasts = all_gather_as_broadcasts

    def _held(self, name: str) -> Span | None:
        j = self.plan.held_tp_rank(self.rank, name)
        return None if j is None else self.plan.specs[name].held_span(j, self.plan.units(name))

    def _pack(self, buf: torch.Tensor, chunks: list[Chunk], local: dict[str, torch.Tensor]) -> None:
        off = 0
        for c in chunks:
            spec, L = self.plan.specs[c.name], self.plan.units(c.name)
            for dst, src in zip(_chunk_views(buf, off, c, spec, L), region_views(local[c.name], spec, self._held(c.name), c.span, c.rows, L)):
                dst.copy_(src)
            off += c.padded

    def run(self, local: dict[str, torch.Tensor], convert: Converter, meter: MemoryMeter, stats: TransferStats) -> Iterator[tuple[str, torch.Tensor]]:
        plan, rank = self.plan, self.rank
        t0 = time.perf_counter()
        open_outputs: dict[str, torch.Tensor] = {}
        for index, bucket in enumerate(plan.buckets):
            my_ops = [op for op in bucket.ops if rank in op.participants]
            size = sum(op.nbytes for op in my_ops)
            buf = meter.empty((size,), torch.uint8, self.device) if size else None
            received: dict[tuple[str, tuple | None], list[tuple[Chunk, int]]] = {}
            off = 0
            # The bucket's exchange as a named range in a profiled step (the assembly below yields
            # to the consumer, so a range cannot stay open around it).
            with profiling.phase(f"sync/bucket_{index}"):
                for op in my_ops:
                    seg = buf[off:off + op.nbytes]
                    for chunk, at in self._run_op(op, seg, local, stats):
                        received.setdefault((chunk.name, chunk.rows), []).append((chunk, off + at))
                    off += op.nbytes
            for entry in bucket.entries if plan.receives(rank) else ():
                name, spec, L = entry.name, plan.specs[entry.name], plan.units(entry.name)
                need, held = plan.needed_span(rank, name), self._held(name)
                if entry.rows is None and held == need:  # the training shard is already the rollout shard
                    yield from self._emit(name, local[name], convert, meter, owned=False)
                    continue
                out = open_outputs.pop(name, None)
                if out is None:
                    out = meter.empty(spec.span_shape(need, L), spec.dtype, self.device)
                overlap = need & held if held is not None else None
                if overlap is not None:
                    for dst, src in zip(region_views(out, spec, need, overlap, entry.rows, L), region_views(local[name], spec, held, overlap, entry.rows, L)):
                        dst.copy_(src)
                for chunk, at in received.get((name, entry.rows), []):
                    for dst, src in zip(region_views(out, spec, need, chunk.span, chunk.rows, L), _chunk_views(buf, at, chunk, spec, L)):
                        dst.copy_(src)
                if entry.last:
                    yield from self._emit(name, out, convert, meter, owned=True)
                else:
                    open_outputs[name] = out
            if buf is not None:
                meter.free(buf)
            del buf
        stats.seconds += time.perf_counter() - t0
        assert not open_outputs, f"unfinished tensors {list(open_outputs)}"

    def _emit(self, name, tensor, convert, meter, owned: bool):
        converted = convert(name, tensor)
        extra = [t for _, t in converted if t.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()]
        for t in extra:
            meter.track(t)
        for item in converted:
            yield item
        for t in extra:
            meter.free(t)
        if owned:
            meter.free(tensor)

    def _run_op(self, op: Op, seg: torch.Tensor, local, stats: TransferStats) -> list[tuple[Chunk, int]]:
        """Run one op; return the chunks this rank received with their offsets in `seg`."""
        rank = self.rank
        stats.collectives += 1
        if op.kind == "all_gather":
            got, at, own = [], 0, None
            for member, chunks in op.segments:
                n = sum(c.padded for c in chunks)
                if member == rank:
                    own = seg[at:at + n]
                    self._pack(own, chunks, local)
                else:
                    off = at
                    for c in chunks:
                        got.append((c, off))
                        off += c.padded
                at += n
            if self.all_gather_as_broadcasts:
                at = 0
                for member, chunks in op.segments:
                    n = sum(c.padded for c in chunks)
                    dist.broadcast(seg[at:at + n], src=member, group=self.groups[op.group])
                    at += n
                stats.collectives += len(op.segments) - 1
            else:
                _all_gather_single(seg, own, group=self.groups[op.group])
            stats.bytes_received += op.nbytes - own.numel()
            stats.payload_received += sum(c.nbytes for c, _ in got)
            stats.bytes_sent += own.numel() * (len(op.group) - 1)
            return got
        if rank == op.src:
            self._pack(seg, op.chunks, local)
            if op.kind == "broadcast":
                dist.broadcast(seg, src=op.src, group=self.groups[op.group])
            else:
                for d in op.dsts:
                    dist.send(seg, dst=d, group=self.p2p_group)
            stats.bytes_sent += op.nbytes * len(op.dsts)
            return []
        if op.kind == "broadcast":
            dist.broadcast(seg, src=op.src, group=self.groups[op.group])
        else:
            dist.recv(seg, src=op.src, group=self.p2p_group)
        stats.bytes_received += op.nbytes
        stats.payload_received += sum(c.nbytes for c in op.chunks)
        got, off = [], 0
        for c in op.chunks:
            got.append((c, off))
            off += c.padded
        return got
