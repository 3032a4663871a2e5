"""Smoke test: benchmarks/delta_sync.py runs end to end at toy sizes (2 processes: real PPO updates,
both sync modes, their streams checked bit-equal inside) and writes `bytes_over_full` per lr."""
from __future__ import annotations

import json

import pytest

from conftest import torchrun

pytestmark = pytest.mark.multiprocess


def test_delta_sync_benchmark_smoke_writes_json(tmp_path):
    out = tmp_path / "result.json"
    torchrun(2, ["benchmarks/delta_sync.py", "--tiny", "--steps", "2", "--models", "moe", "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["bytes_over_full"]) == {"1e-06", "1e-05"}
    # bf16 under AdamW: fewer elements move at the smaller lr, and either way far fewer bytes go than in full
    assert 0 < result["bytes_over_full"]["1e-06"] < result["bytes_over_full"]["1e-05"] < 0.5
    for row in result["models"]["moe"]["1e-05"]["steps"]:
        assert row["delta_bytes"] < row["full_bytes"] and 0 < row["changed_fraction"] < 0.5
