"""Smoke tests: the benchmark scripts run end to end on small CPU settings and write their JSON."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def test_actor_mfu_smoke(tmp_path):
    out = tmp_path / "mfu.json"
    subprocess.run([sys.executable, "benchmarks/actor_mfu.py", "--preset", "tiny", "--iters", "1", "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    # The tiny preset (h 64, 4 heads of 16, 2 kv heads, ffn 128, 2 layers, vocab 301) at 64 tokens:
    # matmul weights per token: qkv (4+2*2)*16*64 = 8192, proj 4096, fc1 16384, fc2 8192 per
    # layer (x2), LM head 301*64 = 19264 -> 92992; the embedding lookup is no matmul. Causal
    # attention at mean context 32: 2 * 32 * 4 heads * (16 + 16) * 2 layers = 16384. Forward
    # + backward = 3 x (2 * 92992 + 16384).
    assert result["model_flops_per_token"] == 3 * (2 * 92992 + 16384)
    # Rounded to significant digits, so however slow the machine the figure is not 0.0.
    assert result["params"] > 100_000 and result["tokens_per_second"] > 0 and result["model_tflops_per_gpu"] > 0


def test_packing_benchmark_smoke(tmp_path):
    out = tmp_path / "packing.json"
    subprocess.run([sys.executable, "benchmarks/packing.py", "--sequences", "6", "--prompt", "8", "--response", "24",
                    "--tokens-per-microbatch", "64", "--rounds", "1", "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    assert result["padding_fraction"]["packed"] < result["padding_fraction"]["padded"]
    assert result["median_seconds_per_step"]["packed"] > 0 and result["speedup_packed_over_padded"] > 0


def test_overhead_benchmark_smoke(tmp_path):
    out = tmp_path / "overhead.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                    "benchmarks/overhead.py", "--preset", "tiny", "--tokens", "128", "--seq-lens", "32", "64",
                    "--rounds", "1", "--out", str(out)], cwd=REPO, check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    assert set(result["by_seq_len"]) == {"32", "64"}
    for row in result["by_seq_len"].values():
        assert row["ratio_megarl_over_baseline"] > 0 and row["ratio_cpu_time"] > 0
        assert len(row["seconds_megarl"]) == len(row["cpu_seconds_baseline"]) == 1
    # The top level is the worse of the two lengths, as the interface names it.
    assert result["ratio_megarl_over_baseline"] == max(r["ratio_megarl_over_baseline"] for r in result["by_seq_len"].values())
    assert result["mfu_megarl"] > 0 and result["mfu_baseline"] > 0
