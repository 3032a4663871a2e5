"""Metrics of a run: `Tracker` fans each step out to the loggers of tracking.loggers.

    tracker.py             Tracker, metrics.jsonl and the console
    mlflow_logger.py       MLflow (a SQLite store in the run dir by default)
    tensorboard_logger.py  TensorBoard event files in <run_dir>/tensorboard
    wandb_logger.py        W&B, offline by default
    prometheus.py          live /metrics for Prometheus (tracking.prometheus_port)
"""
from megarl.tracking.deps import MissingPackage
from megarl.tracking.mlflow_logger import RUN_ID_FILE, default_tracking_uri
from megarl.tracking.tracker import METRICS_FILE, PROGRESS_KEYS, Tracker, read_metrics_file

__all__ = ["METRICS_FILE", "MissingPackage", "PROGRESS_KEYS", "RUN_ID_FILE", "Tracker", "default_tracking_uri",
           "read_metrics_file"]
