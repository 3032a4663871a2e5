"""Weights & Biases: params and step metrics in a W&B run (tracking.loggers: wandb).

Offline by default: the run is written to `<run_dir>/wandb/offline-run-*-<id>/run-<id>.wandb` and
nothing leaves the machine (no key needed); `wandb sync <that directory>` uploads it later. It
goes online only with tracking.wandb_mode=online, or auto with tracking.wandb_project set and a W&B
key at hand (WANDB_API_KEY or `wandb login`). The run id is kept in `<run_dir>/wandb_run_id`.

Steps: every point is logged with `step=` the PPO step, so W&B's step axis is megarl's.

Resume, offline: W&B drops a point whose step is below one it already has, and a restarted
process writes a new offline directory, so re-run steps would appear twice once both directories
are synced. Instead, the run's earlier offline directories are moved to `<run_dir>/wandb_superseded/`
and the new directory starts from metrics.jsonl (already cut back to the steps before start_step):
the run dir holds one W&B run whose history equals metrics.jsonl (the replayed points carry the
resume's wall-clock time). Online: the same run is resumed (resume="allow"); the W&B server keeps
its points of the re-run steps and drops the new ones (the values agree when the resume is exact).
"""
from __future__ import annotations

import netrc
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping

from megarl.config import TrackingConfig
from megarl.tracking.deps import require

RUN_ID_FILE = "wandb_run_id"
SUPERSEDED_DIR = "wandb_superseded"


def wandb_mode(cfg: TrackingConfig) -> str:
    """offline or online, from tracking.wandb_mode (auto: online with a project and a key)."""
    if cfg.wandb_mode != "auto":
        return cfg.wandb_mode
    return "online" if cfg.wandb_project and _has_key() else "offline"


def _has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbLogger:
    """history: the metrics.jsonl records before start_step (replayed into a fresh offline run)."""

    def __init__(self, cfg: TrackingConfig, run_dir: Path, *, resume: bool, params: Mapping[str, Any],
                 history: Iterable[dict]):
        require("wandb", "wandb", "tracking.loggers: wandb")
        import wandb  # deferred: optional (wandb, monitor extra)

        self.mode = wandb_mode(cfg)
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else None
        if run_id is None or not resume:  # a fresh start is a new W&B run
            run_id = secrets.token_hex(4)  # W&B run ids: lowercase letters and digits
            id_file.write_text(run_id + "\n")
        if self.mode == "offline":
            _set_aside(run_dir, run_id)
            # "nothing leaves the machine": W&B's own analytics follow its process-wide settings, not
            # init's mode, and would start OpenTelemetry exporter threads that post to the W&B server
            os.environ.setdefault("WANDB_MODE", "offline")
        # No console capture, system stats, git or code snapshot: metrics only, quietly.
        settings = wandb.Settings(console="off", x_disable_stats=True, x_disable_machine_info=True, disable_git=True,
                                  save_code=False, silent=True)
        self.run = wandb.init(dir=str(run_dir), project=cfg.wandb_project or "megarl", entity=cfg.wandb_entity,
                              name=cfg.run_name or run_dir.resolve().name, id=run_id, mode=self.mode,
                              resume="allow" if self.mode == "online" else None, config=dict(params),
                              settings=settings)
        if self.mode == "offline":
            for record in history:
                step = record["step"]
                if "event" in record:
                    self.event(record["event"], step, {})
                else:
                    self.log({k: v for k, v in record.items() if k != "step"}, step)

    def log(self, values: Mapping[str, float | None], step: int) -> None:
        self.run.log({k: v for k, v in values.items() if v is not None}, step=step)

    def event(self, name: str, step: int, fields: Mapping[str, Any]) -> None:
        self.run.log({f"events/{name}": 1.0}, step=step)

    def close(self, status: str) -> None:
        import wandb  # deferred: optional (wandb, monitor extra)

        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
        # finish() returns before W&B's core process has written the run file to the end (read
        # back at once, it lacked history rows); teardown waits for that process to exit.
        wandb.teardown()


def _set_aside(run_dir: Path, run_id: str) -> None:
    """Move this run's earlier offline directories out of <run_dir>/wandb (`wandb sync` skips them)."""
    earlier = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    if not earlier:
        return
    aside = run_dir / SUPERSEDED_DIR
    aside.mkdir(exist_ok=True)
    for path in earlier:
        shutil.move(str(path), str(aside / path.name))
