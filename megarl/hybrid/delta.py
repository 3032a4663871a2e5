"""Delta weight sync: one segment of a reshard op, sent as only the elements that changed.

After a full sync both ends of every op keep what crossed it (`SegmentCopies`): the sender the
bytes it packed, each receiver the bytes it got. The next sync compares the sender's new packed
segment with its copy element by element, bitwise in the tensor's own dtype (the rollout dtype:
the stream carries the actor's parameters in the engine's dtype), and sends the cheaper of
    indices: int32 index of each changed element + its value        4k + V bytes
    bitmask: one bit per element + the changed values                ceil(E / 8) + V bytes
    full:    the segment as the full sync sends it                   S bytes
(k changed of E elements, V their value bytes, S the padded segment; the indices or bitmask are
padded to 8 bytes). For bf16 the bitmask beats
the indices above k/E = 1/32 and full beats the bitmask above k/E = 15/16. On CPU a second rule,
by time, comes first: a segment whose changed fraction, estimated from 1/64 of the elements, is above
TIME_BREAK_EVEN_FRACTION (1/16) goes full without the element-wise compare (see below). The receiver writes the
values into its copy, which then equals what a full sync would have delivered bit for bit; the
rest of the stream (assembly, convert, the engine's load_weights) is unchanged, so every engine
loads the same tensors either way.

Pure tensor code on one rank; the wire (a 3-integer header, then the payload) is
megarl.hybrid.transfer's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megarl.layout.sync_cost import BITMASK, ENCODINGS, FULL, INDEX_BYTES, INDICES, choose_encoding  # noqa: F401  (the wire's arithmetic)

HEADER_ELEMENTS = 3  # int64 (encoding, changed elements, payload bytes)
HEADER_BYTES = HEADER_ELEMENTS * 8

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Piece:
    """One chunk's bytes inside a packed segment: [offset, offset + nbytes), elements of `itemsize`."""

    offset: int
    nbytes: int
    itemsize: int

    @property
    def numel(self) -> int:
        return self.nbytes // self.itemsize


def _regions(seg: torch.Tensor, pieces: list[Piece]) -> list[torch.Tensor]:
    """The uint8 `seg` as flat integer tensors compared element by element (bitwise). One region,
    the whole segment, when every piece has one element size (the alignment padding between
    pieces is zero on both ends, so it never differs); else one region per piece."""
    sizes = {p.itemsize for p in pieces}
    if len(sizes) == 1:
        size = sizes.pop()
        return [seg[:seg.numel() - seg.numel() % size].view(_INT_VIEW[size])]
    return [seg[p.offset:p.offset + p.nbytes].view(_INT_VIEW[p.itemsize]) for p in pieces]


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [E] -> uint8 [ceil(E / 8)], element i in bit i % 8 of byte i // 8."""
    if mask.device.type == "cpu":  # numpy's packbits is one C loop; the torch form below makes [E/8, 8] temporaries
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    pad = -mask.numel() % 8
    bits = torch.cat([mask, mask.new_zeros(pad)]).view(-1, 8).to(torch.uint8)
    weights = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=mask.device)
    return (bits * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, elements: int) -> torch.Tensor:
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=elements, bitorder="little").view(np.bool_))
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:elements].bool()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


@dataclass
class Encoded:
    """One segment on the wire: `payload` is None for FULL (the segment itself goes)."""

    encoding: int
    changed: int
    elements: int
    payload: torch.Tensor | None

    def header(self, full_bytes: int, device) -> torch.Tensor:
        nbytes = full_bytes if self.payload is None else self.payload.numel()
        return torch.tensor([self.encoding, self.changed, nbytes], dtype=torch.int64, device=device)


# On CPU the element work runs in numpy: torch's bool sum and masked_select measured 5-10x slower
# than numpy's count_nonzero and boolean indexing there (one thread, 32M bf16 elements: encode
# 4.2 s in torch, well under 1 s in numpy). On CUDA the torch forms are the fast ones.
def _changed(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(bool mask of new != old, its count, new's changed values as uint8) for flat integer tensors."""
    if new.device.type == "cpu":
        m = new.numpy() != old.numpy()
        return torch.from_numpy(m), int(np.count_nonzero(m)), torch.from_numpy(new.numpy()[m].view(np.uint8))
    m = new != old
    return m, int(m.sum()), new.masked_select(m).view(torch.uint8)


def _nonzero(mask: torch.Tensor) -> torch.Tensor:
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().view(-1)


def _scatter(region: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """region[index] = values (flat tensors, index int64)."""
    if region.device.type == "cpu":
        region.numpy()[index.numpy()] = values.numpy()
    else:
        region[index] = values


# Time break-even on CPU. There the wire is loopback or shared memory and moves bytes almost for
# free, so what a delta costs is the CPU time of the compare, the value gather and the receiver's
# scatter. Measured (benchmarks/delta_sync.py, issue 42): at 1.3% changed delta took 0.87x a full
# sync's time, at 8-15% changed 1.10-1.18x; linear between the two, the break-even is near 5%.
# A segment whose sampled changed fraction is above TIME_BREAK_EVEN_FRACTION therefore goes whole
# without the full compare. (1/32 was tried: at dense lr 1e-6 step 1, 2.6% changed overall, it sent
# denser buckets whole, bytes 0.63x of full instead of 0.07x.) On CUDA the compare is cheap next to the bytes and only
# the byte rule decides.
TIME_BREAK_EVEN_FRACTION = 1 / 16
# The sample is 1/64 of the elements, read as contiguous blocks of 256 spread evenly over the
# segment: a plain stride of 64 bf16 elements (128 bytes) touches every other cache line and
# measured as slow as the full compare (1.3 ms vs 1.4 ms for 8M elements), the blocks ~1/40 of it.
SAMPLE_BLOCK = 256
SAMPLE_EVERY = 64  # one block in 64
_MIN_SAMPLES = 1024  # below this the estimate is noise; small segments take the exact compare


def _sample(region: torch.Tensor) -> torch.Tensor:
    """Every SAMPLE_EVERY-th block of SAMPLE_BLOCK elements of flat `region`, as a [rows, block] view."""
    width = SAMPLE_BLOCK * SAMPLE_EVERY
    rows = region.numel() // width
    return region[:rows * width].view(rows, width)[:, :SAMPLE_BLOCK]


def sampled_changed(new: torch.Tensor, old: torch.Tensor, pieces: list[Piece]) -> tuple[int, int]:
    """(changed, sampled) over the sampled blocks of each region of `new` vs `old`."""
    changed = sampled = 0
    for n, o in zip(_regions(new, pieces), _regions(old, pieces)):
        ns, os_ = _sample(n), _sample(o)
        changed += int(np.count_nonzero(ns.numpy() != os_.numpy())) if n.device.type == "cpu" else int((ns != os_).sum())
        sampled += ns.numel()
    return changed, sampled


def encode(new: torch.Tensor, old: torch.Tensor, pieces: list[Piece]) -> Encoded:
    """The cheapest encoding of uint8 segment `new` against `old` (same layout, `pieces`). The
    payload is [indices or bitmask, padded to 8 bytes][changed values, region by region]. On CPU
    a segment denser than the time break-even goes FULL, its `changed` then the sample's estimate."""
    elements = sum(p.numel for p in pieces)
    if new.device.type == "cpu":
        sample_changed, sampled = sampled_changed(new, old, pieces)
        if sampled >= _MIN_SAMPLES and sample_changed > TIME_BREAK_EVEN_FRACTION * sampled:
            return Encoded(FULL, round(elements * sample_changed / sampled), elements, None)
    masks, values, changed = [], [], 0
    for n, o in zip(_regions(new, pieces), _regions(old, pieces)):
        m, count, v = _changed(n, o)
        masks.append(m)
        values.append(v)
        changed += count
    slots = sum(m.numel() for m in masks)
    value_bytes = sum(v.numel() for v in values)
    encoding, _ = choose_encoding(slots, changed, value_bytes, new.numel())
    if encoding == FULL:
        return Encoded(FULL, changed, elements, None)
    mask = masks[0] if len(masks) == 1 else torch.cat(masks)
    head = _nonzero(mask).to(torch.int32).view(torch.uint8) if encoding == INDICES else _pack_bits(mask)
    pad = head.new_zeros(_aligned(head.numel()) - head.numel())
    return Encoded(encoding, changed, elements, torch.cat([head, pad, *values]))


def apply(copy: torch.Tensor, encoding: int, changed: int, payload: torch.Tensor, pieces: list[Piece]) -> None:
    """Write a received INDICES or BITMASK `payload` into `copy` (uint8, the last segment received)."""
    regions = _regions(copy, pieces)
    slots = sum(r.numel() for r in regions)
    if encoding == INDICES:
        head = INDEX_BYTES * changed
        index = payload[:head].view(torch.int32).long()
    elif encoding == BITMASK:
        head = -(-slots // 8)
        index = _nonzero(_unpack_bits(payload[:head], slots))
    else:
        raise ValueError(f"not a delta encoding: {encoding}")
    # index is sorted, so each region's changed elements are one contiguous run of it
    at, value_at, first = 0, _aligned(head), 0
    for region in regions:
        last = first + int(torch.searchsorted(index[first:], at + region.numel())) if len(regions) > 1 else index.numel()
        count = last - first
        nbytes = count * region.element_size()
        if count:
            values = payload[value_at:value_at + nbytes]
            if value_at % region.element_size():  # views need aligned storage offsets
                values = values.clone()
            _scatter(region, index[first:last] - at, values.view(region.dtype))
        at += region.numel()
        value_at += nbytes
        first = last


class SegmentCopies:
    """What last crossed each (bucket, op, member) segment this rank sends or receives: the
    trainer's "what it last sent" and the receiver's "what it last got", uint8 on the sync device."""

    def __init__(self):
        self._copies: dict[tuple, torch.Tensor] = {}

    def get(self, key: tuple) -> torch.Tensor | None:
        return self._copies.get(key)

    def replace(self, key: tuple, seg: torch.Tensor) -> None:
        """`seg` (a tensor of its own, not a view into a larger buffer) is now what crossed `key`."""
        self._copies[key] = seg

    def clear(self) -> None:
        self._copies.clear()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self._copies.values())
