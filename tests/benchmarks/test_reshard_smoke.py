"""Smoke test: benchmarks/reshard.py runs under torchrun (tiny sizes) and writes the JSON the issue specifies."""
from __future__ import annotations

import json

import pytest

from conftest import torchrun

pytestmark = pytest.mark.multiprocess


def test_reshard_benchmark_smoke_writes_json(tmp_path):
    out = tmp_path / "result.json"
    # 2 processes keep process start-up cheap; the 4-process configurations are in docs/rollout.md
    torchrun(2, ["benchmarks/reshard.py", "--train-tp", "2", "--rollout-tp", "1", "--num-layers", "2", "--hidden", "64",
                 "--ffn-hidden", "128", "--vocab", "256", "--bucket-mb", "0.05", "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    for key in ("lower_bound_bytes_per_rank", "bucket_bytes", "largest_tensor_bytes"):
        assert isinstance(result[key], (int, float)) and result[key] > 0, key
    for method in ("megarl", "naive"):
        for key in ("bytes_received_per_rank_max", "peak_extra_bytes_max", "seconds"):
            assert result[method][key] > 0, (method, key)
    assert result["checks"]["bytes_within_5pct_of_lower_bound"]
    assert result["checks"]["peak_within_bucket_plus_largest_tensor"]
    assert result["config"]["train"] == {"tp": 2, "pp": 1, "dp": 1}
