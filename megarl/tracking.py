"""Metrics: `<run_dir>/metrics.jsonl` always, MLflow by default, a console progress bar.

Only rank 0 logs; on other ranks every method is a no-op. MLflow needs no server: by default
it writes an SQLite store inside the run directory (MLflow 3.17 refuses the old `./mlruns`
file store unless MLFLOW_ALLOW_FILE_STORE is set). Browse it with
`mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db`. A resumed run appends to the same
metrics.jsonl and the same MLflow run (its id is kept in `<run_dir>/mlflow_run_id`).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

from megarl.config import TrackingConfig

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
RUN_ID_FILE = "mlflow_run_id"
# Progress-bar label -> metric names to show, first present wins (verl metric names).
PROGRESS_KEYS = {
    "score": ("critic/score/mean",),
    "pg_loss": ("actor/pg_loss",),
    "kl": ("actor/reward_kl_penalty", "actor/kl_loss", "actor/ppo_kl"),
}


def default_tracking_uri(run_dir: str | os.PathLike) -> str:
    """SQLite MLflow store inside the run directory."""
    return "sqlite:///" + str(Path(run_dir).resolve() / "mlflow.db")


def _finite_or_none(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


class Tracker:
    """Step metrics and events to metrics.jsonl, MLflow and the console (rank 0 only).

    start_step: the first step this process will log. Lines of metrics.jsonl at or after it (on
    resume: logged after the checkpoint, before the crash) are dropped, so each step appears once.
    resume: continue the MLflow run recorded in the run dir; otherwise start a new one.
    """

    def __init__(self, cfg: TrackingConfig, run_dir: str | os.PathLike, *, rank: int = 0, total_steps: int = 0,
                 start_step: int = 0, resume: bool = False, params: Mapping[str, Any] | None = None,
                 log_every: int = 1):
        self.enabled = rank == 0
        self.cfg, self.run_dir, self.log_every = cfg, Path(run_dir), log_every
        self._client = self._run_id = self._bar = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        self._drop_lines_from(start_step)
        self._file = open(self.metrics_path, "a")
        if cfg.mlflow:
            self._start_mlflow(dict(params or {}), resume, start_step)
        if cfg.progress_bar:
            from tqdm import tqdm
            # start_step is the first step this process logs: that many minus one are already done.
            self._bar = tqdm(total=total_steps, initial=max(start_step - 1, 0), unit="step", dynamic_ncols=True)

    # ---- public API ---------------------------------------------------------------------------
    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record one step's metrics (numbers; tensors/NumPy scalars are converted with float())."""
        if not self.enabled:
            return
        values = {k: _finite_or_none(v) for k, v in metrics.items()}
        self._write({"step": step, **values})
        if self._client is not None:
            from mlflow.entities import Metric
            now = int(time.time() * 1000)
            batch = [Metric(k, v, now, step) for k, v in values.items() if v is not None]
            self._mlflow("log_batch", self._run_id, metrics=batch)
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
        """Record a guard or other event: a metrics.jsonl line with "event", an MLflow tag and count."""
        if not self.enabled:
            return
        self._write({"step": step, "event": name, **fields})
        if self._client is not None:
            self._mlflow("set_tag", self._run_id, f"event/{name}/step_{step}", json.dumps(fields, default=str)[:5000])
            self._mlflow("log_metric", self._run_id, f"events/{name}", 1.0, step=step)
        message = f"step {step}: {name} " + " ".join(f"{k}={v}" for k, v in fields.items())
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self, status: str = "FINISHED") -> None:
        """Flush and end the MLflow run (status FINISHED, FAILED or KILLED)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self._file.close()
        if self._client is not None:
            self._mlflow("set_terminated", self._run_id, status=status)
        self.enabled = False

    @property
    def run_id(self) -> str | None:
        """The MLflow run id (None without MLflow or off rank 0)."""
        return self._run_id

    # ---- internals ----------------------------------------------------------------------------
    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def _drop_lines_from(self, start_step: int) -> None:
        """Keep the lines of steps before start_step (and drop a line a crash cut short)."""
        if not self.metrics_path.exists():
            return
        with open(self.metrics_path) as f:
            lines = f.readlines()
        kept = []
        for line in lines:
            try:
                if json.loads(line)["step"] < start_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        if kept != lines:
            tmp = self.metrics_path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, self.metrics_path)

    def _start_mlflow(self, params: dict, resume: bool, start_step: int = 0) -> None:
        for noisy in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..."
            logging.getLogger(noisy).setLevel(logging.WARNING)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = self.cfg.tracking_uri or default_tracking_uri(self.run_dir)
        with warnings.catch_warnings():  # opening MLflow's SQL store warns inside SQLAlchemy ("noload")
            warnings.simplefilter("ignore", DeprecationWarning)
            self._client = MlflowClient(tracking_uri=uri)
        id_file = self.run_dir / RUN_ID_FILE
        existing = {}
        resumed_from = None
        if resume and id_file.exists():
            self._run_id = id_file.read_text().strip()
            if not _drop_mlflow_points_from(uri, self._run_id, start_step):
                # A tracking server keeps every point and has no call to delete some: the resumed
                # segment gets a run of its own (tagged with the one it continues), so no run
                # holds two points for one step.
                resumed_from, self._run_id = self._run_id, None
        if self._run_id is not None:
            existing = self._client.get_run(self._run_id).data.params
            self._client.update_run(self._run_id, status="RUNNING")
        else:
            experiment = self._client.get_experiment_by_name(self.cfg.experiment)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:  # keep artifacts in the run dir too, not in ./mlruns of the working directory
                experiment_id = self._client.create_experiment(
                    self.cfg.experiment, artifact_location=(self.run_dir.resolve() / "mlartifacts").as_uri())
            run = self._client.create_run(experiment_id, run_name=self.cfg.run_name or self.run_dir.resolve().name)
            self._run_id = run.info.run_id
            id_file.write_text(self._run_id + "\n")
            if resumed_from is not None:
                self._client.set_tag(self._run_id, "megarl.resumed_from_run", resumed_from)
                self._client.set_tag(self._run_id, "megarl.resumed_at_step", str(start_step))
        params = {k: json.dumps(v) if isinstance(v, (list, dict)) else str(v) for k, v in params.items()}
        new = [Param(k, v) for k, v in params.items() if k not in existing]
        for i in range(0, len(new), 100):  # MLflow takes at most 100 params per batch
            self._client.log_batch(self._run_id, params=new[i : i + 100])
        # MLflow params are immutable: a value changed on resume is recorded as a tag.
        for k, v in params.items():
            if k in existing and existing[k] != v:
                self._client.set_tag(self._run_id, f"resume_changed/{k}", v[:5000])

    def _mlflow(self, method: str, *args, **kwargs) -> None:
        """One MLflow call; a tracking-server hiccup is logged, never fatal (metrics.jsonl has it all)."""
        try:
            getattr(self._client, method)(*args, **kwargs)
        except Exception as e:
            logger.warning("MLflow %s failed (%s: %s); metrics.jsonl still has the data", method, type(e).__name__, e)


def _drop_mlflow_points_from(uri: str, run_id: str, start_step: int) -> bool:
    """Delete a run's metric points at or after start_step in a local sqlite MLflow store (the
    default, in the run dir), as metrics.jsonl drops its lines: a resumed run re-logs those steps.
    Returns False when the store is not a local sqlite file (nothing deleted)."""
    import sqlite3

    if not uri.startswith("sqlite:///"):
        return False
    path = uri[len("sqlite:///"):]
    if not os.path.exists(path):
        return False
    con = sqlite3.connect(path)
    try:
        with con:
            con.execute("DELETE FROM metrics WHERE run_uuid = ? AND step >= ?", (run_id, start_step))
            # latest_metrics holds, per key, the point with the greatest (step, timestamp, value)
            rows = con.execute("SELECT key, value, timestamp, step, is_nan FROM metrics WHERE run_uuid = ?", (run_id,)).fetchall()
            latest: dict = {}
            for key, value, timestamp, step, is_nan in rows:
                order = (step, timestamp, value)
                if key not in latest or order > latest[key][0]:
                    latest[key] = (order, (key, value, timestamp, step, is_nan, run_id))
            con.execute("DELETE FROM latest_metrics WHERE run_uuid = ?", (run_id,))
            con.executemany("INSERT INTO latest_metrics (key, value, timestamp, step, is_nan, run_uuid) VALUES (?, ?, ?, ?, ?, ?)",
                            [row for _, row in latest.values()])
    finally:
        con.close()
    return True
