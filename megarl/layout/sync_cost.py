"""What a delta weight sync puts on the wire (rollout.weight_sync.mode=delta), torch-free: the
encoding choice megarl.hybrid.delta makes for each segment, and its share of a full sync that the
planner (megarl.capacity) multiplies the full bytes by.

k changed of E elements of `itemsize` bytes, V = k * itemsize their values, S the full segment:
    indices: 4k + V      bitmask: ceil(E / 8) + V      full: S
(the indices or bitmask are padded to 8 bytes on the wire, and a segment carries a 24-byte header).
"""
from __future__ import annotations

FULL, INDICES, BITMASK = 0, 1, 2
ENCODINGS = {FULL: "full", INDICES: "indices", BITMASK: "bitmask"}
INDEX_BYTES = 4  # int32: one segment never holds 2^31 elements (a bucket is far smaller)


def choose_encoding(elements: int, changed: int, value_bytes: int, full_bytes: int) -> tuple[int, int]:
    """(encoding, payload bytes) of the cheapest way to send `changed` of `elements` elements whose
    values take `value_bytes`, against `full_bytes` for the whole segment; ties go to full."""
    costs = [(full_bytes, FULL), (INDEX_BYTES * changed + value_bytes, INDICES),
             (-(-elements // 8) + value_bytes, BITMASK)]
    nbytes, encoding = min(costs, key=lambda c: (c[0], c[1]))
    return encoding, nbytes


def delta_wire_fraction(changed_fraction: float, itemsize: int = 2) -> float:
    """Bytes of a delta sync over those of a full one when `changed_fraction` of the elements
    changed, for large segments (headers and padding neglected): bf16 at 3% -> 0.09, at 20% -> 0.2625."""
    if not 0.0 <= changed_fraction <= 1.0:
        raise ValueError(f"changed fraction must be in [0, 1], got {changed_fraction}")
    f = changed_fraction
    return min(1.0, f * (INDEX_BYTES + itemsize) / itemsize, 1.0 / (8 * itemsize) + f)
