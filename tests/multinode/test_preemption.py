"""Preemption loses nothing: SIGTERM in the middle of a 6-step run, then the same command again (what a
Slurm requeue does), logs the same metrics as a straight run (1e-6, the resume standard)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "trainer"))
from ppo_helpers import launch_ok, read_metrics, small_run_overrides  # noqa: E402

from megarl.preemption import PREEMPTED_EXIT_CODE  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

COMPARED = ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/ppo_kl", "actor/grad_norm",
            "critic/grad_norm", "critic/returns/mean", "critic/values/mean", "actor/entropy")


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(read_metrics(run_dir)) if path.is_file() else 0


def _worker(launcher: psutil.Process, rank: int) -> psutil.Process:
    for child in launcher.children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "launch/ppo.py" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no worker with RANK={rank} under torchrun")


def test_sigterm_to_one_rank_then_requeue_equals_straight_run(tmp_path):
    steps = {"trainer.total_steps": 6, "data.prompts_per_step": 4, "rollout.samples_per_prompt": 2,
             "actor.ppo_epochs": 1, "critic.ppo_epochs": 1}
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    launch_ok(2, small_run_overrides(tmp_path, straight, **steps))

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "launch/ppo.py",
           "--config", "configs/tiny_cpu.yaml", *small_run_overrides(tmp_path, preempted, **steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            deadline = time.monotonic() + 600
            while _steps_logged(preempted) < 2 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert proc.poll() is None, "the run ended before it could be signalled"
            # Only rank 1 gets the signal: rank 0 must learn of it at the step boundary and stop with it.
            _worker(psutil.Process(proc.pid), rank=1).send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode != 0, out[-4000:]
    assert f"exitcode  : {PREEMPTED_EXIT_CODE}" in out, out[-4000:]  # torchrun's failure report, both ranks
    assert out.count(f"exitcode  : {PREEMPTED_EXIT_CODE}") == 2, out[-4000:]
    assert "SIGTERM: stopped after step" in out, out[-4000:]
    stopped = _steps_logged(preempted)
    assert 2 <= stopped < 6
    checkpoints = sorted(p.name for p in (preempted / "checkpoints").iterdir())
    assert checkpoints == [f"step_{stopped:08d}"]  # exactly one checkpoint, of the last logged step

    proc = launch_ok(2, small_run_overrides(tmp_path, preempted, **steps))  # the requeued job: same command
    assert f"step_{stopped:08d}" in proc.stdout
    a, b = read_metrics(straight), read_metrics(preempted)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b):
        for k in COMPARED:
            assert rb[k] == pytest.approx(ra[k], rel=1e-6, abs=1e-9), f"step {ra['step']} {k}: {ra[k]} vs {rb[k]}"
