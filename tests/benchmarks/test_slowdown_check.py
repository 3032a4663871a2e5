"""`make bench-check` on a real slowdown: the actor's update made 20% slower (MEGARL_BENCH_SLOWDOWN, read
only by benchmarks/_ppo_probe.py) fails the real check against this machine kind's committed baseline,
naming the phase (issue 28). No hand-made figures: the demo is measured, as `make bench` does.

The same measurement without the injected work (the probe logs it apart) passes the phase's gate, so
the failure is the slowdown's, not a stale baseline's or a slow machine's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import suite  # noqa: E402


def test_a_real_20_percent_slower_actor_update_fails_bench_check_naming_the_phase(tmp_path):
    if not suite.baseline_path().is_file():
        pytest.skip(f"no committed baseline for machine kind {suite.machine_kind()!r} (benchmarks/README.md)")
    results = tmp_path / "suite.json"
    env = {"MEGARL_BENCH_SLOWDOWN": "update_actor:0.2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    # Only the PPO part (the phase figures; 2 warm-up + 3 measured steps): the others are reported as skipped.
    run = subprocess.run([sys.executable, "benchmarks/suite.py", "run", "--only", "ppo", "--steps", "5", "--out", str(results)],
                         cwd=REPO, capture_output=True, text=True, env={**os.environ, **env}, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]

    check = subprocess.run([sys.executable, "benchmarks/suite.py", "check", "--results", str(results)], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 1, check.stdout + check.stderr
    assert "REGRESSION: PPO phase 'update_actor':" in check.stdout, check.stdout
    assert "bench-check: FAILED" in check.stdout
    assert "missing now" not in check.stdout  # the parts left out are skipped, and every PPO phase was measured

    # Without the injected 20% (the same steps, the probe's spin subtracted), the phase is within its gate.
    measured = json.loads(results.read_text())
    figure = measured["metrics"]["ppo/update_actor"]
    unslowed = figure["detail"]["value_without_injection"]
    assert figure["value"] / unslowed == pytest.approx(1.2, rel=0.02)  # the injection is 0.2 x the phase's own CPU time
    measured["metrics"] = {"ppo/update_actor": {**figure, "value": unslowed}}
    baseline = json.loads(suite.baseline_path().read_text())
    baseline["metrics"] = {"ppo/update_actor": baseline["metrics"]["ppo/update_actor"]}
    lines, regressions = suite.compare(measured, baseline, tolerance=0.15)
    assert regressions == [], lines
