"""benchmarks/gpu/run_checks.sh --dry-run: the prepared GPU script runs end to end here, on CPU at toy
sizes in float32 (the same code as on the H200), so it does not fail on first contact with a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

@pytest.mark.slow
def test_run_checks_dry_run(tmp_path):
    from megarl.models.families import FAMILIES

    env = dict(os.environ, PYTHON=sys.executable, RESULTS=str(tmp_path))
    env.pop("OUT", None)
    done = subprocess.run(["bash", "benchmarks/gpu/run_checks.sh", "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    peak = json.loads((tmp_path / "matmul_peak_tiny.json").read_text())
    assert peak["ok"] and peak["size"] == 256 and peak["measured_tflops"] > 0

    actor = json.loads((tmp_path / "actor_update_1b_tiny.json").read_text())
    assert actor["complete"] and actor["measured_matmul_tflops"] > 0 and actor["datasheet_peak_tflops"] == 989.0
    assert actor["mfu_of_datasheet_peak"] is None and actor["mfu_of_measured_matmul_peak"] is None  # no MFU on CPU
    assert actor["core_attention"] == "megarl.models.attention.SDPACoreAttention"
    # Tiny preset at 64 tokens (see test_benchmark_smoke: 92992 matmul weights per token, causal
    # attention 16384 at mean context 32): forward 2 * 92992 + 16384 = 202368 per token; the update
    # is forward-only + forward + backward = 4 forwards, over 4 sequences x 64 tokens.
    assert actor["model_flops_per_update"] == 4 * 202368 * 4 * 64
    assert actor["ok"] and len(actor["seconds_per_update"]) == 3 and actor["model_tflops"] > 0

    parity = json.loads((tmp_path / "parity_bf16_tiny.json").read_text())
    assert set(parity["families"]) == set(FAMILIES)  # every family, MoE ones through the MoE forward
    assert parity["complete"] and parity["families_pending"] == []
    for family, row in parity["families"].items():
        assert row["ok"], (family, row)
        assert row["megarl_vs_transformers_fp32"]["max_abs"] <= 1e-4
    assert parity["families"]["qwen3_moe"]["moe"] and not parity["families"]["llama"]["moe"]

    # delta (issue 42): every weight's delta applied bit for bit (the check raises otherwise); fewer
    # bytes than full at both rates, fewer at the smaller one, and a changed fraction below one
    delta = json.loads((tmp_path / "delta_sync_device_tiny.json").read_text())
    assert delta["ok"] and delta["complete"] and set(delta["lrs"]) == {"1e-06", "1e-05"}
    low, high = delta["lrs"]["1e-06"], delta["lrs"]["1e-05"]
    assert 0 < low["bytes_over_full"] < high["bytes_over_full"] < 1 and 0 < low["changed_fraction"] < 1
    assert low["encode_gbps"] > 0 and low["apply_gbps"] > 0 and low["break_even_link_gbps"] > 0


def test_parity_writes_each_family_as_it_goes(monkeypatch, tmp_path):
    """A time-out after the first family keeps its numbers: the JSON is rewritten after every family."""
    import argparse

    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    import checks

    def fake_parity_one(family, model_dir, dims, gpu, lengths, gen):  # stands in for the model runs
        if family == "qwen2":
            raise RuntimeError("boom")
        return {"ok": True, "moe": False, "megarl_vs_transformers_fp32": {"max_abs": 0.0, "mean_abs": 0.0}}

    monkeypatch.setattr(checks, "parity_one", fake_parity_one)
    saved = []
    args = argparse.Namespace(families=["llama", "qwen2", "qwen3"], tiny=True)
    final = checks.parity(args, None, False, lambda result: saved.append(json.loads(json.dumps(result))))
    assert [s["complete"] for s in saved] == [False, False, False, True]
    assert list(saved[0]["families"]) == ["llama"] and saved[0]["families_pending"] == ["qwen2", "qwen3"]
    assert "boom" in saved[1]["families"]["qwen2"]["error"] and not saved[1]["ok"]
    assert final == saved[-1] and not final["ok"]
