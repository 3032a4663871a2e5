"""Runs a reshard plan on one rank: instrumented collectives, bucket buffers, shard assembly.

Memory: per bucket one byte buffer holds everything this rank sends or receives in it (at most
bucket_bytes by construction of the plan); rollout shards are then assembled one tensor at a
time, converted, yielded and dropped. Peak extra memory is therefore one bucket plus one tensor
(plus whatever new tensors the converter allocates), which `MemoryMeter` measures.

Bytes: `TransferStats.bytes_received` counts what crosses the wire into this rank (a rank's own
segment of an all-gather is not counted; alignment padding, at most 7 bytes per chunk, is).

Delta sync (rollout.weight_sync.mode=delta, megarl.hybrid.delta): every segment of an op goes as
a 3-integer header and then either the segment itself or only its changed elements; an all-gather
becomes one broadcast per member (its segments' sizes now differ). Both ends keep what crossed
each segment (`SegmentCopies`), and the receiver rebuilds the full segment from its copy before the
assembly below, which is the same for both modes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megarl.runtime import profiling
from megarl.hybrid import delta
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
    full_bytes_received: int = 0  # what a full sync puts on the wire into this rank (= bytes_received in full mode)
    elements_received: int = 0  # elements of the segments received
    changed_received: int = 0  # of which changed since the last sync (the sender's count; all of them in a full sync)


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
                 all_gather_as_broadcasts: bool = False, p2p_group=None, copies: delta.SegmentCopies | None = None):
        self.plan, self.rank, self.groups, self.device = plan, rank, groups, device
        # delta sync: what last crossed each segment (None: every sync is full, no header)
        self.copies = copies
        self._full = True  # this sync sends every segment in full (the first, and every full_every-th)
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

    def run(self, local: dict[str, torch.Tensor], convert: Converter, meter: MemoryMeter, stats: TransferStats,
            full: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """full=False (with copies): segments go as deltas against what last crossed them."""
        plan, rank = self.plan, self.rank
        self._full = full
        t0 = time.perf_counter()
        open_outputs: dict[str, torch.Tensor] = {}
        for index, bucket in enumerate(plan.buckets):
            my_ops = [op for op in bucket.ops if rank in op.participants]
            # delta: no bucket buffer; each segment lives in its copy (SegmentCopies), kept to the next sync
            size = sum(op.nbytes for op in my_ops) if self.copies is None else 0
            buf = meter.empty((size,), torch.uint8, self.device) if size else None
            # (tensor name, rows) -> the received chunks, each with the byte tensor and offset holding it
            received: dict[tuple[str, tuple | None], list[tuple[Chunk, torch.Tensor, int]]] = {}
            off = 0
            # The bucket's exchange as a named range in a profiled step (the assembly below yields
            # to the consumer, so a range cannot stay open around it).
            with profiling.phase(f"sync/bucket_{index}"):
                for op_index, op in enumerate(my_ops):
                    if self.copies is None:
                        seg = buf[off:off + op.nbytes]
                        got = [(chunk, buf, off + at) for chunk, at in self._run_op(op, seg, local, stats)]
                        off += op.nbytes
                    else:
                        got = self._run_op_delta(op, local, stats, (index, op_index), meter)
                    for chunk, src, at in got:
                        received.setdefault((chunk.name, chunk.rows), []).append((chunk, src, at))
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
                for chunk, held_in, at in received.get((name, entry.rows), []):
                    for dst, src in zip(region_views(out, spec, need, chunk.span, chunk.rows, L), _chunk_views(held_in, at, chunk, spec, L)):
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

    def _run_op(self, op: Op, seg: torch.Tensor, local, stats: TransferStats, key: tuple = ()) -> list[tuple[Chunk, int]]:
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
            stats.full_bytes_received += op.nbytes - own.numel()
            stats.payload_received += sum(c.nbytes for c, _ in got)
            stats.elements_received += sum(c.nbytes // self.plan.specs[c.name].itemsize for c, _ in got)
            stats.changed_received += sum(c.nbytes // self.plan.specs[c.name].itemsize for c, _ in got)
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
        stats.full_bytes_received += op.nbytes
        stats.payload_received += sum(c.nbytes for c in op.chunks)
        stats.elements_received += sum(c.nbytes // self.plan.specs[c.name].itemsize for c in op.chunks)
        stats.changed_received += sum(c.nbytes // self.plan.specs[c.name].itemsize for c in op.chunks)
        return _offsets(op.chunks)

    # ---------------------------------------------------------------- delta sync
    def _run_op_delta(self, op: Op, local, stats: TransferStats, key: tuple, meter: MemoryMeter) -> list[tuple[Chunk, torch.Tensor, int]]:
        """`_run_op` under delta sync: each member's segment (the src's, for broadcast and p2p)
        goes from its sender as header + full or delta payload. A segment is packed into, or
        received into, a tensor of its own that becomes its copy (no bucket buffer, no copying):
        returns the chunks received, each with the copy holding it and its offset there."""
        stats.collectives += 1
        segments = op.segments if op.kind == "all_gather" else [(op.src, op.chunks)]
        got = []
        for member, chunks in segments:
            pieces, seg_key = self._pieces(chunks), key + (member,)
            if member == self.rank:
                self._send_segment(op, member, chunks, local, pieces, seg_key, stats, meter)
            else:
                held_in = self._recv_segment(op, member, sum(c.padded for c in chunks), pieces, seg_key, stats, meter)
                got.extend((c, held_in, off) for c, off in _offsets(chunks))
                stats.payload_received += sum(c.nbytes for c in chunks)
        if op.kind == "all_gather":
            stats.collectives += 2 * len(segments) - 1
        return got

    def _pieces(self, chunks: list[Chunk]) -> list[delta.Piece]:
        return [delta.Piece(off, c.nbytes, self.plan.specs[c.name].itemsize) for c, off in _offsets(chunks)]

    def _transmit(self, op: Op, member: int, t: torch.Tensor, sending: bool) -> None:
        """`t` from `member` to the op's other participants (broadcast in the group, or p2p)."""
        if op.kind == "p2p":
            if sending:
                for d in op.dsts:
                    dist.send(t, dst=d, group=self.p2p_group)
            else:
                dist.recv(t, src=member, group=self.p2p_group)
        else:
            dist.broadcast(t, src=member, group=self.groups[op.group])

    def _receivers(self, op: Op) -> int:
        return len(op.dsts) if op.kind == "p2p" else len(op.participants) - 1

    def _send_segment(self, op: Op, member: int, chunks: list[Chunk], local, pieces, key: tuple, stats: TransferStats,
                      meter: MemoryMeter) -> None:
        part = meter.empty((sum(c.padded for c in chunks),), torch.uint8, self.device)  # the next copy: the old one lives until then
        for p in pieces:  # alignment padding zeroed, so it never reads as a change
            part[p.offset + p.nbytes:p.offset + -(-p.nbytes // 8) * 8].zero_()
        self._pack(part, chunks, local)
        old = None if self._full else self.copies.get(key)
        enc = (delta.encode(part, old, pieces) if old is not None
               else delta.Encoded(delta.FULL, sum(p.numel for p in pieces), sum(p.numel for p in pieces), None))
        self._transmit(op, member, enc.header(part.numel(), part.device), sending=True)
        body = part if enc.payload is None else enc.payload
        meter.track(body)  # the payload is the only temporary; part replaces the copy below
        self._transmit(op, member, body, sending=True)
        meter.free(body)
        stats.bytes_sent += (delta.HEADER_BYTES + body.numel()) * self._receivers(op)
        self.copies.replace(key, part)
        meter.free(part)

    def _recv_segment(self, op: Op, member: int, nbytes_full: int, pieces, key: tuple, stats: TransferStats,
                      meter: MemoryMeter) -> torch.Tensor:
        """Receive one segment; return the tensor holding it whole (its copy, updated)."""
        header = torch.empty(delta.HEADER_ELEMENTS, dtype=torch.int64, device=self.device)
        self._transmit(op, member, header, sending=False)
        encoding, changed, nbytes = (int(v) for v in header.tolist())
        if encoding == delta.FULL:
            assert nbytes == nbytes_full, (key, nbytes, nbytes_full)
            held_in = torch.empty(nbytes_full, dtype=torch.uint8, device=self.device)
            self._transmit(op, member, held_in, sending=False)
            self.copies.replace(key, held_in)
        else:
            held_in = self.copies.get(key)
            assert held_in is not None, f"delta segment {key} from rank {member} but no full one came before it"
            payload = meter.empty((nbytes,), torch.uint8, self.device)
            self._transmit(op, member, payload, sending=False)
            delta.apply(held_in, encoding, changed, payload, pieces)
            meter.free(payload)
        elements = sum(p.numel for p in pieces)
        stats.bytes_received += delta.HEADER_BYTES + nbytes
        stats.full_bytes_received += nbytes_full
        stats.elements_received += elements
        stats.changed_received += changed  # the sender's count (estimated from a sample when the CPU time rule sent the segment whole)
        return held_in


def _offsets(chunks: list[Chunk]) -> list[tuple[Chunk, int]]:
    """Each chunk with its byte offset in a packed buffer (chunks padded to ALIGN)."""
    out, off = [], 0
    for c in chunks:
        out.append((c, off))
        off += c.padded
    return out
