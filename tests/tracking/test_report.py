"""megarl.tools.report: every curve drawn is the metrics file's data (read back from the figures)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from megarl.tools.report import build_report


def _write(run_dir, records):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


RUN_A = [
    {"step": 1, "critic/score/mean": 0.1, "actor/entropy": 2.0, "actor/pg_loss": -0.5, "actor/grad_norm": 3.0,
     "timing_s/gen": 1.0, "timing_s/update_actor": 3.0, "timing_s/step": 4.0, "perf/cpu_rss_gb": 1.25,
     "response_length/mean": 3.5, "actor/reward_kl_penalty_coeff": 0.05},
    {"step": 1, "event": "guard/kl", "kl": 2.0},  # an event line: not a point
    {"step": 2, "critic/score/mean": 0.4, "actor/entropy": 1.5, "actor/pg_loss": -0.25, "actor/grad_norm": None,
     "timing_s/gen": 2.0, "timing_s/update_actor": 6.0, "timing_s/step": 10.0, "perf/cpu_rss_gb": 1.5,
     "response_length/mean": 4.0, "actor/reward_kl_penalty_coeff": 0.1, "val/score/mean": 0.3},
]
RUN_B = [{"step": s, "critic/score/mean": 0.2 * s, "critic/vf_loss": 1.0 / s, "timing_s/gen": 1.0, "timing_s/step": 2.0}
         for s in (1, 2, 3)]


def test_each_curve_is_the_metrics_file_for_two_runs_side_by_side(tmp_path):
    _write(tmp_path / "a" / "run", RUN_A)
    _write(tmp_path / "b" / "run", RUN_B)  # same directory name: labelled with the parent
    drawn = build_report([tmp_path / "a" / "run", tmp_path / "b" / "run"], tmp_path / "out" / "report.html")
    a, b = "a/run", "b/run"
    assert drawn["report_score.png"] == {
        a: {"critic/score/mean": ([1, 2], [0.1, 0.4]), "val/score/mean": ([2], [0.3])},
        b: {"critic/score/mean": ([1, 2, 3], [0.2, 0.4, 0.2 * 3])}}
    assert drawn["report_grad_norms.png"] == {a: {"actor/grad_norm": ([1], [3.0])}, b: {}}  # null: no point
    assert drawn["report_losses.png"] == {a: {"actor/pg_loss": ([1, 2], [-0.5, -0.25])},
                                          b: {"critic/vf_loss": ([1, 2, 3], [1.0, 0.5, 1 / 3])}}
    assert drawn["report_phase_share.png"] == {
        a: {"timing_s/gen": ([1, 2], [0.25, 0.2]), "timing_s/update_actor": ([1, 2], [0.75, 0.6])},
        b: {"timing_s/gen": ([1, 2, 3], [0.5, 0.5, 0.5])}}
    assert drawn["report_memory.png"][a] == {"perf/cpu_rss_gb": ([1, 2], [1.25, 1.5])}
    assert drawn["report_kl_coef.png"][a] == {"actor/reward_kl_penalty_coeff": ([1, 2], [0.05, 0.1])}
    assert "report_kl.png" not in drawn  # neither run logged a KL
    page = (tmp_path / "out" / "report.html").read_text()
    for png in drawn:
        assert f'<img src="{png}"' in page
        assert (tmp_path / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_line_writes_the_report_and_refuses_a_directory_without_metrics(tmp_path):
    _write(tmp_path / "run", RUN_B)
    cmd = [sys.executable, "-m", "megarl.tools.report"]
    done = subprocess.run(cmd + [str(tmp_path / "run"), "--out", str(tmp_path / "r.html")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.glob("r_*.png")) == ["r_losses.png", "r_phase_share.png", "r_score.png"]
    bad = subprocess.run(cmd + [str(tmp_path / "nothing")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "metrics.jsonl does not exist" in bad.stderr


@pytest.mark.parametrize("name", ["report_demo_score.png"])
def test_the_readme_picture_is_committed(name):
    assert (REPO / "docs" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"docs/{name}" in (REPO / "README.md").read_text()
