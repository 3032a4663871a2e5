"""TensorBoard: step metrics as scalars in `<run_dir>/tensorboard` (tracking.loggers: tensorboard).

`tensorboard --logdir <run_dir>/tensorboard`. The tags are the metric names of metrics.jsonl (so
`actor/pg_loss` sits in TensorBoard's `actor` group) and the steps are the PPO steps.

Resume: the writer opens with `purge_step=start_step`, which writes a SessionLog START event at
that step; TensorBoard's readers (the UI and `EventAccumulator`) then discard every point at or
after it from earlier event files, so the steps a resumed run re-runs appear once, with the new
values (the same rule as metrics.jsonl and the MLflow store).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from megarl.tracking.deps import require

TENSORBOARD_DIR = "tensorboard"


class TensorBoardLogger:
    def __init__(self, run_dir: Path, *, start_step: int):
        require("tensorboard", "tensorboard", "tracking.loggers: tensorboard")
        from torch.utils.tensorboard import SummaryWriter  # deferred: optional (tensorboard, monitor extra)

        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=start_step)

    def log(self, values: Mapping[str, float | None], step: int) -> None:
        for name, value in values.items():
            if value is not None:  # a non-finite value is null in metrics.jsonl and absent here, as in MLflow
                self.writer.add_scalar(name, value, step)
        self.writer.flush()  # one flush a step: a live `tensorboard` sees each step as it ends

    def event(self, name: str, step: int, fields: Mapping[str, Any]) -> None:
        self.writer.add_scalar(f"events/{name}", 1.0, step)
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()
