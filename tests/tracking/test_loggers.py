"""TensorBoard and W&B (offline) beside metrics.jsonl: same names, same steps, same values, and
no step twice after a resume (megarl.tracking). Read back with TensorBoard's EventAccumulator and
from the W&B run file (tests/tracking/wandb_files.py)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import REPO
from logger_files import jsonl_rows, tensorboard_scalars, wandb_history
from megarl.config import ConfigError, TrackingConfig, check_monitor_packages, load_config, validate
from megarl.tracking import Tracker

BASE = ["model.path=/tmp/model", "data.train_files=[/tmp/train.parquet]"]
ALL = TrackingConfig(loggers=["console", "jsonl", "mlflow", "tensorboard", "wandb"], progress_bar=False)


def _step(step: int, segment: int = 0) -> dict:
    # float32-exact values: TensorBoard stores scalars as float32
    return {"critic/score/mean": 0.25 * step + segment, "actor/pg_loss": -0.5 * step, "timing_s/gen": 1.5,
            "actor/grad_norm": float("nan") if step == 2 else 2.0}



def _assert_equal(expected: dict, got: dict, name: str, rel: float = 0.0):
    assert sorted(got) == sorted(expected), f"{name}: steps {sorted(got)} != metrics.jsonl's {sorted(expected)}"
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=rel), f"{name} step {step}"


def test_every_logger_holds_the_jsonl_values_and_a_resume_duplicates_no_step(tmp_path):
    run_dir = tmp_path / "run"
    tracker = Tracker(ALL, run_dir, total_steps=4)
    for step in (1, 2, 3, 4):
        tracker.log(_step(step), step)
    tracker.event("guard/kl", 4, kl=2.5)
    tracker.close("KILLED")
    first = jsonl_rows(run_dir)
    assert first[2] == {"critic/score/mean": 0.5, "actor/pg_loss": -1.0, "timing_s/gen": 1.5}  # NaN: absent
    assert first[4]["events/guard/kl"] == 1.0
    _assert_equal(first, tensorboard_scalars(run_dir), "tensorboard")
    _assert_equal(first, wandb_history(run_dir), "wandb")

    # Resume from a checkpoint at step 2: steps 3 and 4 run again with other values.
    tracker = Tracker(ALL, run_dir, total_steps=5, start_step=3, resume=True)
    for step in (3, 4, 5):
        tracker.log(_step(step, segment=10), step)
    tracker.close()
    rows = jsonl_rows(run_dir)
    assert sorted(rows) == [1, 2, 3, 4, 5] and rows[4]["critic/score/mean"] == 11.0 and "events/guard/kl" not in rows[4]
    _assert_equal(rows, tensorboard_scalars(run_dir), "tensorboard")
    _assert_equal(rows, wandb_history(run_dir), "wandb")
    assert len(list((run_dir / "wandb_superseded").iterdir())) == 1  # the first segment's directory, set aside


def test_tensorboard_keeps_float32_of_each_value(tmp_path):
    run_dir = tmp_path / "run"
    tracker = Tracker(TrackingConfig(loggers=["jsonl", "tensorboard"]), run_dir)
    tracker.log({"actor/ppo_kl": 0.1, "critic/vf_loss": 1e-7}, 1)
    tracker.close()
    assert tensorboard_scalars(run_dir)[1] == {"actor/ppo_kl": np.float32(0.1), "critic/vf_loss": np.float32(1e-7)}


def test_old_mlflow_switch_and_logger_choice(tmp_path):
    cfg = load_config(None, BASE + ["tracking.mlflow=false"])
    assert cfg.tracking.active_loggers() == ("console", "jsonl")
    cfg = load_config(None, BASE + ["tracking.loggers=[wandb,jsonl,mlflow]", "tracking.mlflow=true"])
    assert cfg.tracking.active_loggers() == ("jsonl", "mlflow", "wandb")
    with pytest.raises(ConfigError, match=r"tracking.mlflow=true \(the older switch\) but tracking.loggers=\['jsonl'\] has no "
                                          r"mlflow: add mlflow to tracking.loggers, or drop tracking.mlflow"):
        validate(load_config(None, BASE + ["tracking.loggers=[jsonl]", "tracking.mlflow=true"]))
    # verl-style choices on any shipped config: exactly what was asked for
    for config in sorted((REPO / "configs").glob("*.yaml")):
        chosen = load_config(str(config), ["tracking.loggers=[console,tensorboard]"]).tracking
        assert chosen.active_loggers() == ("console", "tensorboard"), config.name
    assert load_config(None, BASE).tracking.active_loggers() == ("console", "jsonl", "mlflow")
    with pytest.raises(ConfigError, match=r"tracking.loggers: 'neptune' is not one of console, jsonl, mlflow"):
        load_config(None, BASE + ["tracking.loggers=[neptune]"])
    with pytest.raises(ConfigError, match="wandb without jsonl"):
        validate(load_config(None, BASE + ["tracking.loggers=[wandb]"]))
    with pytest.raises(ConfigError, match=r"trainer.profile_steps \[7\] outside the run's steps 1..5"):
        validate(load_config(None, BASE + ["trainer.total_steps=5", "trainer.profile_steps=[2,7]"]))

    # Without MLflow, TensorBoard or W&B, nothing of theirs is written.
    tracker = Tracker(TrackingConfig(loggers=["jsonl"]), tmp_path / "r")
    tracker.log({"a": 1.0}, 1)
    tracker.close()
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["metrics.jsonl"]


def test_a_missing_logger_package_is_one_line_naming_the_pip_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = load_config(None, BASE + ["tracking.loggers=[jsonl,wandb]"])
    with pytest.raises(ConfigError) as err:
        check_monitor_packages(cfg)
    assert str(err.value) == ("tracking.loggers: wandb needs the wandb package, which is not installed: "
                              "pip install 'megarl[monitor]' (or pip install wandb)")


def test_offline_wandb_starts_no_analytics_exporter(tmp_path):
    # wandb.init(mode="offline") alone still starts W&B's OpenTelemetry exporters (they post to the W&B
    # server, and their after-fork handler crashed a later fork); a fresh process without WANDB_MODE,
    # as a user's run is (this test process sets it: conftest)
    import os
    import subprocess
    import sys

    code = ("import threading; from pathlib import Path; from megarl.config import TrackingConfig; "
            "from megarl.tracking.wandb_logger import WandbLogger; "
            f"w = WandbLogger(TrackingConfig(loggers=['jsonl', 'wandb'], progress_bar=False), Path({str(tmp_path)!r}), "
            "resume=False, params={}, history=[]); w.log({'a': 1.0}, 1); w.run.finish(); "
            "print(sorted(t.name for t in threading.enumerate()))")
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    threads = proc.stdout.strip().splitlines()[-1]
    assert "wandb" in threads and "Otel" not in threads, threads
