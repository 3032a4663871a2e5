"""MLflow: params, step metrics and guard events in a run (tracking.loggers: mlflow).

MLflow needs no server: by default it writes an SQLite store inside the run directory (MLflow 3.17
refuses the old `./mlruns` file store unless MLFLOW_ALLOW_FILE_STORE is set). Browse it with
`mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db`. A resumed run continues the same
MLflow run (its id is kept in `<run_dir>/mlflow_run_id`) after deleting the points of the steps it
re-runs.
"""
from __future__ import annotations

import json
import logging
import os
import time
import warnings
from pathlib import Path
import sqlite3
from typing import Any, Mapping

from megarl.config import TrackingConfig

logger = logging.getLogger(__name__)

RUN_ID_FILE = "mlflow_run_id"


def default_tracking_uri(run_dir: str | os.PathLike) -> str:
    """SQLite MLflow store inside the run directory."""
    return "sqlite:///" + str(Path(run_dir).resolve() / "mlflow.db")


class MlflowLogger:
    """One MLflow run per run directory. resume: continue the run recorded there (its points at or
    after start_step deleted); otherwise start a new one."""

    def __init__(self, cfg: TrackingConfig, run_dir: Path, *, start_step: int, resume: bool,
                 params: Mapping[str, Any]):
        self.cfg, self.run_dir = cfg, run_dir
        self._client = self._run_id = None
        self._start_mlflow(dict(params), resume, start_step)

    def log(self, values: Mapping[str, float | None], step: int) -> None:
        from mlflow.entities import Metric  # deferred: mlflow (seconds to import) loads only when tracking.loggers has it

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in values.items() if v is not None]
        self._mlflow("log_batch", self._run_id, metrics=batch)

    def event(self, name: str, step: int, fields: Mapping[str, Any]) -> None:
        self._mlflow("set_tag", self._run_id, f"event/{name}/step_{step}", json.dumps(dict(fields), default=str)[:5000])
        self._mlflow("log_metric", self._run_id, f"events/{name}", 1.0, step=step)

    def close(self, status: str) -> None:
        self._mlflow("set_terminated", self._run_id, status=status)

    @property
    def run_id(self) -> str | None:
        return self._run_id

    def _start_mlflow(self, params: dict, resume: bool, start_step: int) -> None:
        for noisy in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..."
            logging.getLogger(noisy).setLevel(logging.WARNING)
        # deferred: mlflow (seconds to import) loads only when tracking.loggers has it
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
