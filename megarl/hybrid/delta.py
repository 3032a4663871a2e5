"""Delta weight sync: one segment of a reshard op, sent as only the elements that changed.

After a full sync both ends of every op keep what crossed it (`SegmentCopies`): the sender the
bytes it packed, each receiver the bytes it got. The next sync compares the sender's new packed
segment with its copy element by element, bitwise in the tensor's own dtype (the rollout dtype:
the stream carries the actor's parameters in the engine's dtype), and sends the cheaper of
    indices: int32 index of each changed element + its value        4k + V bytes
    bitmask: one bit per element + the changed values                ceil(E / 8) + V bytes
    full:    the segment as the full sync sends it                   S bytes
(k changed of E elements, V their value bytes, S the padded segment). For bf16 the bitmask beats
the indices above k/E = 1/32 and full beats the bitmask above k/E = 15/16. The receiver writes the
values into its copy, which then equals what a full sync would have delivered bit for bit; the
rest of the stream (assembly, convert, the engine's load_weights) is unchanged, so every engine
loads the same tensors either way.

Pure tensor code on one rank; the wire (a 3-integer header, then the payload) is
megarl.hybrid.transfer's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FULL, INDICES, BITMASK = 0, 1, 2
ENCODINGS = {FULL: "full", INDICES: "indices", BITMASK: "bitmask"}
INDEX_BYTES = 4  # int32: one segment never holds 2^31 elements (a bucket is far smaller)
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


def choose_encoding(elements: int, changed: int, value_bytes: int, full_bytes: int) -> tuple[int, int]:
    """(encoding, payload bytes) of the cheapest way to send `changed` of `elements` elements whose
    values take `value_bytes`, against `full_bytes` for the whole segment; ties go to full."""
    costs = [(full_bytes, FULL), (INDEX_BYTES * changed + value_bytes, INDICES),
             (-(-elements // 8) + value_bytes, BITMASK)]
    nbytes, encoding = min(costs, key=lambda c: (c[0], c[1]))
    return encoding, nbytes


def _views(seg: torch.Tensor, pieces: list[Piece]) -> list[torch.Tensor]:
    """Each piece of the uint8 `seg` as a flat integer tensor of its element size (bitwise compare)."""
    return [seg[p.offset:p.offset + p.nbytes].view(_INT_VIEW[p.itemsize]) for p in pieces]


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [E] -> uint8 [ceil(E / 8)], element i in bit i % 8 of byte i // 8."""
    pad = -mask.numel() % 8
    bits = torch.cat([mask, mask.new_zeros(pad)]).view(-1, 8).to(torch.uint8)
    weights = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=mask.device)
    return (bits * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, elements: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:elements].bool()


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


def encode(new: torch.Tensor, old: torch.Tensor, pieces: list[Piece]) -> Encoded:
    """The cheapest encoding of uint8 segment `new` against `old` (same layout, `pieces`)."""
    masks, values = [], []
    for n, o in zip(_views(new, pieces), _views(old, pieces)):
        m = n != o
        masks.append(m)
        values.append(n[m].view(torch.uint8))
    elements = sum(p.numel for p in pieces)
    changed = int(sum(int(m.sum()) for m in masks))
    value_bytes = sum(v.numel() for v in values)
    encoding, _ = choose_encoding(elements, changed, value_bytes, new.numel())
    if encoding == FULL:
        return Encoded(FULL, changed, elements, None)
    if encoding == INDICES:
        starts, at = [], 0
        for p in pieces:
            starts.append(at)
            at += p.numel
        index = torch.cat([m.nonzero().view(-1) + s for m, s in zip(masks, starts)]).to(torch.int32)
        head = index.view(torch.uint8)
    else:
        head = _pack_bits(torch.cat(masks))
    return Encoded(encoding, changed, elements, torch.cat([head, *values]))


def apply(copy: torch.Tensor, encoding: int, changed: int, payload: torch.Tensor, pieces: list[Piece]) -> None:
    """Write a received INDICES or BITMASK `payload` into `copy` (uint8, the last segment received)."""
    elements = sum(p.numel for p in pieces)
    if encoding == INDICES:
        head = INDEX_BYTES * changed
        index = payload[:head].view(torch.int32).long()
        mask = torch.zeros(elements, dtype=torch.bool, device=copy.device)
        mask[index] = True
    elif encoding == BITMASK:
        head = -(-elements // 8)
        mask = _unpack_bits(payload[:head], elements)
    else:
        raise ValueError(f"not a delta encoding: {encoding}")
    at, value_at = 0, head
    for p, view in zip(pieces, _views(copy, pieces)):
        m = mask[at:at + p.numel]
        count = int(m.sum())
        if count:  # a clone: the values of a piece need not sit aligned to its element size in the payload
            view[m] = payload[value_at:value_at + count * p.itemsize].clone().view(view.dtype)
        at += p.numel
        value_at += count * p.itemsize


class SegmentCopies:
    """What last crossed each (bucket, op, member) segment this rank sends or receives: the
    trainer's "what it last sent" and the receiver's "what it last got", uint8 on the sync device."""

    def __init__(self):
        self._copies: dict[tuple, torch.Tensor] = {}

    def get(self, key: tuple) -> torch.Tensor | None:
        return self._copies.get(key)

    def store(self, key: tuple, seg: torch.Tensor) -> None:
        held = self._copies.get(key)
        if held is None or held.numel() != seg.numel():
            self._copies[key] = seg.clone()
        else:
            held.copy_(seg)

    def clear(self) -> None:
        self._copies.clear()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self._copies.values())
