"""megarl.hybrid.delta on one rank: the encoding choice by hand-worked byte counts, and a round trip
(encode on the sender's copy, apply on the receiver's) that rebuilds the new segment bit for bit, for
each encoding, with pieces of two element sizes and alignment padding between them. The wire and the
20-step runs across layouts and placements: tests/hybrid/test_reshard.py."""
from __future__ import annotations

import pytest
import torch

from megarl.hybrid import delta


@pytest.mark.parametrize("changed,expected,nbytes", [
    (10, delta.INDICES, 4 * 10 + 20),      # 1000 bf16 elements: indices 60 < bitmask 125 + 20
    (40, delta.BITMASK, 125 + 80),         # indices 240 > bitmask 205 (above 1/32 of the elements)
    (31, delta.INDICES, 4 * 31 + 62),      # 186 < 187: just below the indices / bitmask break-even
    (937, delta.BITMASK, 125 + 1874),      # 1999 < 2000: just below 15/16 of the elements
    (938, delta.FULL, 2000),               # 2001 > 2000: past the break-even the segment goes whole
])
def test_choose_encoding_hand_worked(changed, expected, nbytes):
    assert delta.choose_encoding(1000, changed, 2 * changed, 2000) == (expected, nbytes)


def _segment(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[delta.Piece]]:
    """Pack tensors into one uint8 segment, each padded to 8 bytes (zeros), as the plan's buffers are."""
    seg, pieces, off = [], [], 0
    for t in parts:
        raw = t.reshape(-1).view(torch.uint8)
        pad = -raw.numel() % 8
        seg += [raw, torch.zeros(pad, dtype=torch.uint8)]
        pieces.append(delta.Piece(off, raw.numel(), t.element_size()))
        off += raw.numel() + pad
    return torch.cat(seg), pieces


@pytest.mark.parametrize("fraction,encoding", [(0.01, delta.INDICES), (0.3, delta.BITMASK), (1.0, delta.FULL)])
@pytest.mark.parametrize("mixed", [False, True], ids=["bf16", "bf16+fp32"])
def test_round_trip_rebuilds_the_new_segment_bitwise(fraction, encoding, mixed):
    g = torch.Generator().manual_seed(0)
    old_parts = [torch.randn(333, generator=g).bfloat16(), torch.randn(7, 5, generator=g).bfloat16()]
    if mixed:
        old_parts.append(torch.randn(101, generator=g))  # fp32: compared as 4-byte elements
    new_parts = []
    for t in old_parts:
        moved = torch.rand(t.shape, generator=g) < fraction
        new_parts.append(torch.where(moved, -t if fraction == 1.0 else (t.float() * 1.05).to(t.dtype), t))
    old, pieces = _segment(old_parts)
    new, _ = _segment(new_parts)
    changed = sum(int((a.view(-1).view(torch.uint8) != b.view(-1).view(torch.uint8)).view(-1, a.element_size()).any(1).sum())
                  for a, b in zip(old_parts, new_parts))
    enc = delta.encode(new, old, pieces)
    assert (enc.encoding, enc.changed, enc.elements) == (encoding, changed, sum(p.numel for p in pieces))
    if encoding == delta.FULL:
        assert enc.payload is None
        return
    assert enc.payload.numel() < new.numel()
    receiver = old.clone()
    delta.apply(receiver, enc.encoding, enc.changed, enc.payload, pieces)
    assert torch.equal(receiver, new)


def test_nan_and_signed_zero_count_as_changes():
    # bitwise, not numeric, comparison: -0.0 == 0.0 and NaN != NaN would both lose an update
    old = torch.tensor([0.0, float("nan"), 1.0, 2.0] * 64, dtype=torch.bfloat16)
    new = old.clone()
    new[0], new[1] = -0.0, float("inf")
    seg_old, pieces = _segment([old])
    seg_new, _ = _segment([new])
    enc = delta.encode(seg_new, seg_old, pieces)
    assert enc.changed == 2 and enc.encoding == delta.INDICES
    receiver = seg_old.clone()
    delta.apply(receiver, enc.encoding, enc.changed, enc.payload, pieces)
    assert torch.equal(receiver, seg_new)


@pytest.mark.parametrize("fraction,encoding", [(0.01, delta.INDICES), (0.10, delta.FULL)])
def test_time_break_even_sends_a_dense_cpu_segment_whole(fraction, encoding):
    # 2**17 bf16 elements: 8 blocks of 256 (2048) sampled, past _MIN_SAMPLES. At 10% changed the bytes
    # rule alone would pick BITMASK; on CPU the sample (about 10% > 1/16) sends it whole instead.
    g = torch.Generator().manual_seed(1)
    old_t = torch.randn(2 ** 17, generator=g).bfloat16()
    moved = torch.rand(old_t.shape, generator=g) < fraction
    new_t = torch.where(moved, (old_t.float() * 1.05).to(old_t.dtype), old_t)
    old, pieces = _segment([old_t])
    new, _ = _segment([new_t])
    changed = int((old != new).view(-1, 2).any(1).sum())
    assert delta.choose_encoding(2 ** 17, changed, 2 * changed, new.numel())[0] != delta.FULL
    enc = delta.encode(new, old, pieces)
    assert enc.encoding == encoding
    if encoding == delta.FULL:
        assert enc.payload is None
        assert abs(enc.changed - changed) < 0.2 * changed  # the sample's estimate, for the metrics
        return
    assert enc.changed == changed
    receiver = old.clone()
    delta.apply(receiver, enc.encoding, enc.changed, enc.payload, pieces)
    assert torch.equal(receiver, new)
