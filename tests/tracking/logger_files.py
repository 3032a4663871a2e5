"""Reading back what the loggers wrote in a run directory: metrics.jsonl, TensorBoard scalars and the W&B history."""
from __future__ import annotations

from pathlib import Path

import wandb_files

from megarl.tracking import read_metrics_file


def jsonl_rows(run_dir: Path) -> dict[int, dict]:
    """{step: {name: value}} from metrics.jsonl, events as `events/<name>` = 1.0; a step twice fails."""
    rows: dict[int, dict] = {}
    for r in read_metrics_file(run_dir / "metrics.jsonl"):
        row = rows.setdefault(r["step"], {})
        if "event" in r:
            row[f"events/{r['event']}"] = 1.0
        else:
            assert not any(k in row for k in r if k != "step"), f"step {r['step']} appears twice in metrics.jsonl"
            row.update({k: v for k, v in r.items() if k != "step" and v is not None})
    return rows


def tensorboard_scalars(run_dir: Path) -> dict[int, dict[str, float]]:
    """{step: {tag: value}} as TensorBoard shows it (EventAccumulator, which applies purges)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    rows: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"{tag}: a step appears twice: {steps}"
        for e in events:
            rows.setdefault(e.step, {})[tag] = e.value
    return rows


def wandb_history(run_dir: Path) -> dict[int, dict[str, float]]:
    """The history of the one offline W&B run in <run_dir>/wandb."""
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    dirs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(dirs) == 1, f"expected one offline directory of run {run_id}, found {dirs}"
    return wandb_files.history(dirs[0] / f"run-{run_id}.wandb")
