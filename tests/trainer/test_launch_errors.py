"""Misconfigurations exit with code 2 and a one-line message naming the problem, no traceback."""
from __future__ import annotations

import subprocess

import pytest

from conftest import torchrun


def run_launch(args: list[str], world_size: int = 1) -> subprocess.CompletedProcess:
    """One plain process that believes it is one of world_size (the checks run before any rendezvous)."""
    return torchrun(0, ["launch/ppo.py", *args], timeout=120, env={"WORLD_SIZE": str(world_size)}, check=False)


@pytest.mark.parametrize(
    "args,world,expected",
    [
        (["--config", "configs/tiny_cpu.yaml", "actor.optim.lrr=1e-6"], 1, "actor.optim.lr"),  # unknown key, nearest named
        (["--config", "configs/tiny_cpu.yaml", "parallel.tp=two"], 1, "parallel.tp"),  # wrong type
        (["--config", "configs/tiny_cpu.yaml", "parallel.tp=4"], 2, "world size 2 is not divisible"),  # impossible layout
        (["--config", "configs/tiny_cpu.yaml", "algorithm.adv_estimator=ppo2"], 1, "gae"),  # unknown enum lists valid ones
        (["--config", "configs/tiny_cpu.yaml", "data.auto_prepare=null", "data.train_files=[/nonexistent/train.parquet]"], 1,
         "/nonexistent/train.parquet"),  # missing data file
        (["--config", "configs/does_not_exist.yaml"], 1, "configs/does_not_exist.yaml"),  # missing config file
        (["--config", "configs/tiny_cpu.yaml", "model.make_tiny.enable=false", "model.path=/nonexistent/model"], 1,
         "/nonexistent/model"),  # missing model directory
        (["--config", "configs/tiny_cpu.yaml", "data.prompts_per_step=33"], 2, "not divisible"),  # batch sizes
    ],
    ids=["unknown-key", "wrong-type", "layout", "enum", "missing-data", "missing-config", "missing-model", "batch-size"],
)
def test_misconfiguration_exits_2_with_one_line(args, world, expected):
    proc = run_launch(args, world)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert expected in lines[0], lines[0]
