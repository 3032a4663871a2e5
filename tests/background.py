"""Long, self-contained runs that the suite starts once, at the start of the session, at the lowest CPU
priority (nice 19), so that they use the cores the other tests leave idle (a rank waiting on a
rendezvous, a Slurm requeue, a heartbeat's timeout) instead of running alone when their turn comes. The
test that reads one waits for it; with the early start off, it starts the run itself at normal priority.

    from background import shared
    runs = shared("demo-seeds", start_fn)   # start_fn(root, nice) -> an object with stop()

A run is keyed by name and started once per session (tests/conftest.py starts the ones whose tests were
collected; `MEGARL_TEST_BACKGROUND=0` turns the early start off). Nothing here is asserted: the tests
that read a run assert what it did.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

_RUNS: dict = {}
_ROOT: list[Path] = []


def enabled() -> bool:
    return os.environ.get("MEGARL_TEST_BACKGROUND", "1") != "0"


def _root() -> Path:
    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="megarl-background-")))
    return _ROOT[0]


def start(name: str, start_fn: Callable, nice: bool = True):
    """Start the run `name` now (in the background, niced unless told otherwise) unless it runs already."""
    if name not in _RUNS:
        root = _root() / name
        root.mkdir(parents=True, exist_ok=True)
        _RUNS[name] = start_fn(root, nice)
    return _RUNS[name]


def shared(name: str, start_fn: Callable):
    """The session's run `name`: the one started at the session's start, else one started now at normal
    priority (a test run on its own has nothing to overlap with)."""
    return start(name, start_fn, nice=False)


def stop_all() -> None:
    """End what is still running (a session that stopped early) and remove the runs' files."""
    import shutil

    for run in _RUNS.values():
        run.stop()
    _RUNS.clear()
    for root in _ROOT:
        shutil.rmtree(root, ignore_errors=True)
    _ROOT.clear()


def lower_priority() -> None:
    """preexec_fn for a background run's processes (their children inherit it)."""
    os.nice(19)
