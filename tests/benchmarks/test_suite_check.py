"""`suite.py compare-record`: a `run`'s figures against the stored record, on hand-made results (no timing here)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from conftest import REPO

spec = importlib.util.spec_from_file_location("suite", REPO / "benchmarks" / "suite.py")
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)

BASELINE = {"machine_kind": "cpu-2", "metrics": {
    "ppo/update_actor": {"value": 10.0, "gate": True},
    "ppo/update_critic": {"value": 9.0, "gate": True},
    "ppo/adv": {"value": 0.01, "gate": False},
    "sync/megarl_over_naive": {"value": 0.6, "gate": True},
    "_calibration_cpu_s": {"value": 0.05, "gate": False}}}


def _with(**values) -> dict:
    metrics = {k: dict(v) for k, v in BASELINE["metrics"].items()}
    for k, v in values.items():
        metrics[k.replace("__", "/")]["value"] = v
    return {"machine_kind": "cpu-2", "metrics": metrics}


def test_unchanged_and_noise_pass():
    _, regressions = suite.compare(_with(ppo__update_actor=11.0, ppo__adv=0.05), BASELINE, tolerance=0.15)
    assert regressions == []  # 10% noise passes; an ungated phase may move freely


def test_a_20_percent_slower_phase_is_named():
    lines, regressions = suite.compare(_with(ppo__update_actor=12.0), BASELINE, tolerance=0.15)
    assert len(regressions) == 1 and regressions[0].startswith("PPO phase 'update_actor': 1.20x its baseline")
    assert any(line.strip().startswith("REGRESSION") and "ppo/update_actor" in line for line in lines)


def test_a_missing_figure_fails():
    current = _with()
    del current["metrics"]["sync/megarl_over_naive"]
    _, regressions = suite.compare(current, BASELINE, tolerance=0.15)
    assert regressions == ["sync/megarl_over_naive: measured in the baseline, missing now"]


def test_compare_record_prints_what_is_slower_than_the_stored_record_and_gates_nothing(tmp_path):
    # The stored baselines are a record of machines and dates (issue 38); the gate is `suite.py check`.
    base, now = tmp_path / "base.json", tmp_path / "now.json"
    base.write_text(json.dumps(BASELINE))
    now.write_text(json.dumps(_with(sync__megarl_over_naive=0.9)))

    def compare_record(*extra):
        return subprocess.run([sys.executable, "benchmarks/suite.py", "compare-record", "--results", str(now), *extra], cwd=REPO,
                              capture_output=True, text=True)

    proc = compare_record("--baseline", str(base))
    assert proc.returncode == 0 and "slower than the record: sync/megarl_over_naive: 1.50x" in proc.stdout
    now.write_text(json.dumps({**_with(), "machine_kind": "no-such-machine"}))
    proc = compare_record()
    assert proc.returncode == 2 and "no baseline for machine kind 'no-such-machine'" in proc.stderr


def test_a_figure_may_carry_its_own_tolerance():
    base = {"machine_kind": "cpu-2", "metrics": {"sync/megarl_over_naive": {"value": 0.6, "gate": True, "tolerance": 0.30}}}
    now = {"machine_kind": "cpu-2", "metrics": {"sync/megarl_over_naive": {"value": 0.75, "gate": True}}}
    assert suite.compare(now, base, tolerance=0.15)[1] == []  # 1.25x: inside its 30%
    now["metrics"]["sync/megarl_over_naive"]["value"] = 0.8
    assert suite.compare(now, base, tolerance=0.15)[1][0].startswith("sync/megarl_over_naive: 1.33x")


def test_the_trl_ratio_and_the_per_optimizer_step_cost_are_gated_and_a_skipped_trl_run_is_not_missing():
    base = {"machine_kind": "cpu-2", "metrics": {
        "vs_trl/megarl_over_trl": {"value": 0.8, "gate": True, "tolerance": 0.30},
        "ppo/update_actor_per_optimizer_step": {"value": 0.6, "gate": True}}}
    now = {"machine_kind": "cpu-2", "metrics": {
        "vs_trl/megarl_over_trl": {"value": 1.2, "gate": True},  # 1.5x its baseline
        "ppo/update_actor_per_optimizer_step": {"value": 0.72, "gate": True}}}  # 1.2x
    regressions = suite.compare(now, base, tolerance=0.15)[1]
    assert regressions == ["PPO phase 'update_actor_per_optimizer_step': 1.20x its baseline (0.7200 vs 0.6000; tolerance 15%)",
                           "vs_trl/megarl_over_trl: 1.50x its baseline (1.2000 vs 0.8000; tolerance 30%)"]
    del now["metrics"]["vs_trl/megarl_over_trl"]
    now["metrics"]["ppo/update_actor_per_optimizer_step"]["value"] = 0.6
    assert suite.compare(now, base, tolerance=0.15)[1] == ["vs_trl/megarl_over_trl: measured in the baseline, missing now"]
    lines, regressions = suite.compare({**now, "skipped": ["vs_trl/megarl_over_trl"]}, base, tolerance=0.15)
    assert regressions == [] and any(line.strip().startswith("skipped") and "vs_trl" in line for line in lines)


def test_parts_left_out_by_run_only_are_skipped_and_a_partial_baseline_refresh_keeps_the_rest():
    current = {"machine_kind": "cpu-2", "metrics": {k: v for k, v in BASELINE["metrics"].items() if k.startswith(("ppo/", "_"))},
               "skipped_parts": {"sync": "run --only"}}
    lines, regressions = suite.compare(current, BASELINE, tolerance=0.15)
    assert regressions == []
    assert [line.split()[:2] for line in lines if "sync/" in line] == [["skipped", "sync/megarl_over_naive"]]
    assert "(skipped on request: run --only)" in next(line for line in lines if "sync/" in line)

    new = {"machine_kind": "cpu-2", "metrics": {"ppo/update_actor": {"value": 11.0, "gate": True},
                                                "_calibration_cpu_s": {"value": 0.04, "gate": False}}}
    merged = suite.merge_baseline(BASELINE, new, ("ppo",))
    # The re-measured part's old figures all go (update_critic: a phase no longer run); sync stays as it was.
    assert merged["metrics"] == {"sync/megarl_over_naive": {"value": 0.6, "gate": True},
                                 "ppo/update_actor": {"value": 11.0, "gate": True},
                                 "_calibration_cpu_s": {"value": 0.04, "gate": False}}
    assert merged["remeasured_parts"] == ["ppo"] and BASELINE["metrics"]["ppo/update_critic"]["value"] == 9.0  # old one untouched
