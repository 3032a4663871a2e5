"""Tracker: one step's metrics and events to every chosen logger (rank 0 only).

tracking.loggers picks them: console (a progress bar, or a line every trainer.log_every steps),
jsonl (`<run_dir>/metrics.jsonl`, one object per step), mlflow, tensorboard, wandb; with
tracking.prometheus_port, rank 0 also serves live metrics. Each logger gets the same names and the
same step numbers. On other ranks every method is a no-op.

Resume: start_step is the first step this process logs. Every logger forgets what an earlier
process logged at or after it (logged after the checkpoint, before the crash), so each step
appears once everywhere: metrics.jsonl drops those lines, MLflow deletes those points, TensorBoard
purges them, W&B restarts its offline run from metrics.jsonl (see each logger's module).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from tqdm import tqdm

from megarl.config import TrackingConfig
from megarl.tracking.mlflow_logger import MlflowLogger
from megarl.tracking.prometheus import PrometheusExporter
from megarl.tracking.tensorboard_logger import TensorBoardLogger
from megarl.tracking.wandb_logger import WandbLogger

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # tracking.sample_ids: the trained samples of each step
# Progress-bar label -> metric names to show, first present wins (verl metric names).
PROGRESS_KEYS = {
    "score": ("critic/score/mean",),
    "pg_loss": ("actor/pg_loss",),
    "kl": ("actor/reward_kl_penalty", "actor/kl_loss", "actor/ppo_kl"),
    "loss": ("sft/loss", "rm/loss"),  # the supervised stages (megarl.supervised)
    "acc": ("rm/accuracy",),
}


def _finite_or_none(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics_file(path: Path) -> list[dict]:
    """The records of a metrics.jsonl (a line cut short by a crash is skipped)."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "step" in record:
                records.append(record)
    return records


class Tracker:
    """Step metrics and events to the loggers of tracking.loggers (rank 0 only).

    resume: continue the MLflow / W&B runs recorded in the run dir; otherwise start new ones.
    """

    def __init__(self, cfg: TrackingConfig, run_dir: str | os.PathLike, *, rank: int = 0, total_steps: int = 0,
                 start_step: int = 0, resume: bool = False, params: Mapping[str, Any] | None = None,
                 log_every: int = 1):
        self.enabled = rank == 0
        self.cfg, self.run_dir, self.log_every = cfg, Path(run_dir), log_every
        self.loggers: dict[str, Any] = {}
        self._bar = self._file = self._samples = self.prometheus = None
        if not self.enabled:
            return
        chosen = cfg.active_loggers()
        self.console = "console" in chosen
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        _drop_lines_from(self.metrics_path, start_step)
        if "jsonl" in chosen:
            self._file = open(self.metrics_path, "a")
        if cfg.sample_ids:
            _drop_lines_from(self.run_dir / SAMPLES_FILE, start_step)
            self._samples = open(self.run_dir / SAMPLES_FILE, "a")
        params = dict(params or {})
        if "mlflow" in chosen:
            self.loggers["mlflow"] = MlflowLogger(cfg, self.run_dir, start_step=start_step, resume=resume, params=params)
        if "tensorboard" in chosen:
            self.loggers["tensorboard"] = TensorBoardLogger(self.run_dir, start_step=start_step)
        if "wandb" in chosen:
            self.loggers["wandb"] = WandbLogger(cfg, self.run_dir, resume=resume, params=params,
                                                history=read_metrics_file(self.metrics_path))
        if cfg.prometheus_port is not None:
            self.prometheus = self.loggers["prometheus"] = PrometheusExporter(cfg.prometheus_host, cfg.prometheus_port)
            print(f"megarl: live metrics at http://{self.prometheus.host}:{self.prometheus.port}/metrics", flush=True)
        if self.console and cfg.progress_bar:
            # start_step is the first step this process logs: that many minus one are already done.
            self._bar = tqdm(total=total_steps, initial=max(start_step - 1, 0), unit="step", dynamic_ncols=True)

    # ---- public API ---------------------------------------------------------------------------
    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record one step's metrics (numbers; tensors/NumPy scalars are converted with float())."""
        if not self.enabled:
            return
        values = {k: _finite_or_none(v) for k, v in metrics.items()}
        self._write({"step": step, **values})
        for logger in self.loggers.values():
            logger.log(values, step)
        if not self.console:
            return
        shown = {}
        for label, names in PROGRESS_KEYS.items():
            name = next((n for n in names if values.get(n) is not None), None)
            if name is not None:
                shown[label] = f"{values[name]:.3g}"
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)
        elif step % self.log_every == 0:
            print(f"step {step} " + " ".join(f"{k}={v}" for k, v in shown.items()), flush=True)

    def event(self, name: str, step: int, **fields: Any) -> None:
        """Record a guard or other event: a metrics.jsonl line with "event", `events/<name>` = 1 in
        MLflow, TensorBoard and W&B (plus an MLflow tag with the fields), a Prometheus counter."""
        if not self.enabled:
            return
        self._write({"step": step, "event": name, **fields})
        for logger in self.loggers.values():
            logger.event(name, step, fields)
        if not self.console:
            return
        message = f"step {step}: {name} " + " ".join(f"{k}={v}" for k, v in fields.items())
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def samples(self, step: int, records: list) -> None:
        """tracking.sample_ids: one samples.jsonl line of the step's trained samples, each
        [dataset row, prompt index, sample index, versions of its tokens or null], and under
        rollout.placement=fleet the server that generated it."""
        if self._samples is not None:
            self._samples.write(json.dumps({"step": step, "samples": records}) + "\n")
            self._samples.flush()

    def close(self, status: str = "FINISHED") -> None:
        """Flush and end every logger's run (status FINISHED, FAILED or KILLED)."""
        if not self.enabled:
            return
        if self._samples is not None:
            self._samples.close()
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        for logger in self.loggers.values():
            logger.close(status)
        self.enabled = False

    @property
    def run_id(self) -> str | None:
        """The MLflow run id (None without MLflow or off rank 0)."""
        mlflow = self.loggers.get("mlflow")
        return None if mlflow is None else mlflow.run_id

    # ---- internals ----------------------------------------------------------------------------
    def _write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, default=str) + "\n")
            self._file.flush()


def _drop_lines_from(path: Path, start_step: int) -> None:
    """Keep the lines of steps before start_step (and drop a line a crash cut short)."""
    if not path.exists():
        return
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] < start_step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    if kept != lines:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
