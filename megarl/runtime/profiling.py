"""Profiling chosen steps (trainer.profile_steps, trainer.profiler) with named ranges.

    torch: the torch profiler records each chosen step on every rank and writes a Chrome trace,
           `<run_dir>/profile/step_<N>/rank<R>.json` (chrome://tracing or https://ui.perfetto.dev).
    nvtx:  NVTX ranges and cudaProfilerStart/Stop around each chosen step, for
           `nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat ...` (GPU only).

Each phase of the PPO step (`ppo_step/sync`, `ppo_step/gen`, ..., the names of its timing_s/*
metrics) and each weight-sync bucket (`sync/bucket_<i>`) is a named range (`phase`). Outside the
chosen steps `phase` returns one shared null context and nothing is recorded: the other steps pay
a global read per phase (benchmarks/profiler_overhead.py measures it).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

PROFILE_DIR = "profile"
_NULL = contextlib.nullcontext()
_active: str | None = None  # the profiler recording the current step, or None


def phase(name: str):
    """A named range while a chosen step is recorded; a null context otherwise."""
    if _active is None:
        return _NULL
    if _active == "nvtx":
        return torch.cuda.nvtx.range(name)

    return torch.profiler.record_function(name)


def trace_path(run_dir: str | Path, step: int, rank: int) -> Path:
    """Where the torch profiler's Chrome trace of `step` on `rank` goes."""
    return Path(run_dir) / PROFILE_DIR / f"step_{step:08d}" / f"rank{rank}.json"


class StepProfiler:
    """`with profiler.step(n):` records step n when it is one of `steps`; otherwise does nothing."""

    def __init__(self, kind: str, steps, run_dir: str | Path, rank: int):
        self.kind, self.steps, self.run_dir, self.rank = kind, frozenset(steps), Path(run_dir), rank
        if kind == "nvtx" and self.steps:
            if not torch.cuda.is_available():
                raise ValueError("trainer.profiler=nvtx records NVTX ranges for Nsight Systems, which needs CUDA; "
                                 "use trainer.profiler=torch on this machine")

    def step(self, step: int):
        if step not in self.steps:
            return _NULL
        return self._recorded(step)

    @contextlib.contextmanager
    def _recorded(self, step: int):
        global _active

        if self.kind == "nvtx":
            torch.cuda.profiler.start()
            _active = "nvtx"
            try:
                with torch.cuda.nvtx.range(f"ppo_step {step}"):
                    yield
            finally:
                _active = None
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            _active = "torch"
            try:
                with torch.profiler.record_function(f"ppo_step {step}"):
                    yield
            finally:
                _active = None
        path = trace_path(self.run_dir, step, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
