"""GPU kinds the planner knows: memory, dense bf16 peak and link bandwidths.

Extend it with `--gpu-table FILE.json` ({"name": {"memory_gib": ..., "bf16_tflops": ...,
"nvlink_gb_s": ..., "ib_gb_s": ...}}); bandwidths are per GPU and per direction, in GB/s (1e9).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    bf16_tflops: float  # dense
    nvlink_gb_s: float  # per GPU, one direction
    ib_gb_s: float  # per GPU (one NIC per GPU), one direction


# Vendor datasheets (dense bf16; NVLink 4 = 900 GB/s bidirectional; 400 Gb/s NDR per GPU).
GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("h100-80gb", 80, 989, 450, 50),
    GPU("h200-141gb", 141, 989, 450, 50),
    GPU("h20-96gb", 96, 148, 450, 50),
    GPU("h800-80gb", 80, 989, 200, 50),
    GPU("a100-80gb", 80, 312, 300, 25),
    GPU("a100-40gb", 40, 312, 300, 25),
    GPU("b200-180gb", 180, 2250, 900, 50),
    GPU("l40s-48gb", 48, 362, 32, 25),  # no NVLink: PCIe 4 x16
)}


def gpu_table(extra: str | Path | None = None) -> dict[str, GPU]:
    """The built-in table, updated from a JSON file when given; ValueError names a bad entry."""
    table = dict(GPUS)
    if extra is None:
        return table
    try:
        entries = json.loads(Path(extra).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--gpu-table {extra}: cannot read it as JSON ({err})") from None
    fields = ("memory_gib", "bf16_tflops", "nvlink_gb_s", "ib_gb_s")
    for name, e in entries.items():
        missing = [f for f in fields if not isinstance(e, dict) or f not in e]
        if missing:
            raise ValueError(f"--gpu-table {extra}: entry {name!r} lacks {', '.join(missing)} (needs {', '.join(fields)})")
        table[name] = GPU(name, *(float(e[f]) for f in fields))
    return table
