"""Helpers to run launch/ppo.py as a user would, on small settings."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import shared_runs
import worlds
from conftest import torchrun


def prepared_data(root: Path, train_size: int = 256, val_size: int = 16) -> None:
    """<root>/train.parquet and test.parquet of the demo task: data.auto_prepare never writes a
    path given on the command line, so runs that move the data files prepare them first."""
    from megarl.data.prepare import prepare_arithmetic

    if not (root / "train.parquet").exists():
        prepare_arithmetic(root, "copy", 3, train_size, val_size)


def small_run_overrides(root: Path, run_dir: Path, **extra) -> list[str]:
    """configs/tiny_cpu.yaml shrunk to a few cheap steps, with all paths under `root`."""
    prepared_data(root)
    base = {
        "model.path": str(root / "model"),
        "data.train_files": f"[{root / 'train.parquet'}]",
        "data.val_files": f"[{root / 'test.parquet'}]",
        "data.arithmetic.train_size": 256,
        "data.arithmetic.val_size": 16,
        "data.prompts_per_step": 8,
        "rollout.samples_per_prompt": 4,
        "actor.ppo_mini_batches": 2,
        "critic.ppo_mini_batches": 2,
        "actor.ppo_epochs": 2,
        "critic.ppo_epochs": 2,
        "trainer.run_dir": str(run_dir),
        "tracking.progress_bar": "false",
        "trainer.save_every_steps": 0,
        "model.sequence_packing": "true",  # the default of real configs (the demo pads)
        "algorithm.adv_estimator": "gae",  # the demo runs GRPO; these runs test the critic path too
        # MLflow's SQL store costs about 3.6 s of start-up per run (measured with cProfile on a 1-process
        # 2-step run of 12.6 s); tests/tracking and the demo-seeds test cover the MLflow logger itself.
        "tracking.loggers": "[console,jsonl]",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def shared_overrides(run_dir: Path, config: str = "configs/tiny_cpu.yaml", **extra) -> list[str]:
    """`small_run_overrides` on the session's shared inputs (tests/shared_runs.py): the data under one
    session directory and, unless `extra` names a model.path, the tiny random model of the run's
    `model.make_tiny` settings (one directory per settings), so that a run can be compared with a
    shared reference run (`reference_run`) of the same inputs."""
    root = shared_runs.inputs_root()
    overrides = small_run_overrides(root, run_dir, **extra)
    if "model.path" not in extra:
        cfg = shared_runs.resolved(config, overrides)
        if cfg.model.make_tiny.enable:
            overrides.append(f"model.path={shared_runs.tiny_model_dir(cfg.model.make_tiny)}")
    return overrides


def reference_run(nproc: int, config: str = "configs/tiny_cpu.yaml", **extra) -> Path:
    """The run directory of `shared_overrides(..., **extra)` run on `nproc` processes (0: one plain
    process), run once per session and keyed by its resolved config: every test that compares against
    the same run reads the same one."""
    key = shared_runs.run_key(config, shared_overrides(Path("unused"), config, **extra), nproc)

    def run(run_dir: Path) -> None:
        proc = launch_ok(nproc, shared_overrides(run_dir, config, **extra), config=config)
        (run_dir / "launch.log").write_text(proc.stdout)  # what the launch printed, for the tests that read it

    return shared_runs.once(key, run)


def launch(nproc: int, overrides: list[str], config: str = "configs/tiny_cpu.yaml", timeout: int = 900,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the trainer; nproc 0 means plain `python launch/ppo.py` (one process, no torchrun);
    `env`: variables added to this process's environment."""
    return torchrun(nproc, ["launch/ppo.py", "--config", config, *overrides], timeout=timeout, check=False, env=env)


def launch_ok(nproc: int, overrides: list[str], config: str = "configs/tiny_cpu.yaml", timeout: int = 900,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """launch/ppo.py run to success, as a job of the session's world of nproc ranks where it fits one
    (nproc 0: the world of one), else as its own launch; fails the test with the output's tail."""
    argv = ["--config", config, *overrides]
    if worlds.fits(nproc, ["launch/ppo.py", *argv], env):
        proc = worlds.world(max(nproc, 1)).ppo(argv, timeout=timeout)
    else:
        proc = launch(nproc, overrides, config=config, timeout=timeout, env=env)
    if proc.returncode != 0:
        pytest.fail(f"launch/ppo.py exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in r]
