"""Reads the history of an offline W&B run back from its `run-<id>.wandb` file, for the tests.

wandb 0.31 ships no Python reader (the old `wandb.sdk.internal.datastore` is gone; its Go core
reads and writes the file). The format is small: a 7-byte header (b":W&B", magic 0xBEE1, version
0), then LevelDB-log records in 32 KiB blocks, each a 7-byte header (CRC-32 of type byte + data,
length, type: 1 full, 2 first, 3 middle, 4 last) and a piece of one serialized
`wandb_internal_pb2.Record`. The CRCs are checked, so a misread file fails loudly.
"""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK = 32768
HEADER = struct.Struct("<4sHB")
RECORD = struct.Struct("<IHB")


def records(path: Path):
    """Every Record in the file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, pending = HEADER.size, b""
    while pos + RECORD.size <= len(data):
        if BLOCK - pos % BLOCK < RECORD.size:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = RECORD.unpack_from(data, pos)
        pos += RECORD.size
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0
            continue
        chunk = data[pos:pos + length]
        pos += length
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad checksum at byte {pos}"
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def history(path: Path) -> dict[int, dict[str, float]]:
    """{step: {key: value}} of the run's history rows (the _step, _runtime, _timestamp keys removed)."""
    rows: dict[int, dict] = {}
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        step = int(row.pop("_step"))
        assert step not in rows, f"step {step} appears twice"
        rows[step] = {k: v for k, v in row.items() if not k.startswith("_")}
    return rows
