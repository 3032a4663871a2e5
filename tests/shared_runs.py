"""Reference runs shared, not repeated: a run that tests compare against (the one-process run of a
layout test) runs once per session, keyed by its resolved config.

    from shared_runs import once, run_key
    key = run_key("configs/tiny_cpu.yaml", overrides, nproc=0)   # the resolved config, not its spelling
    run_dir = once(key, lambda run_dir: ...)                       # made on first use, then reused

The key is a hash of the config as the trainer resolves it (defaults filled in, `key=value`
overrides applied, values parsed), without `trainer.run_dir` (where a run writes does not change
what it computes), and of the number of processes. Two tests that ask for the same run in a
different spelling (an override repeating a default, "2" for 2, another order) get the one run.
A run that failed is remembered as failed: the next test that asks fails with the same message
instead of paying for the run again.

The inputs are shared the same way (`inputs_root`, `tiny_model_dir`): the demo's data under one
session directory, and one tiny random model per `model.make_tiny` setting (the trainer creates a
missing model from those settings alone, so the settings name it).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

_ROOT: list[Path] = []
_RUNS: dict[str, Path | BaseException] = {}


def inputs_root() -> Path:
    """The session's directory for shared inputs and runs (removed at the session's end: `cleanup`)."""
    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="megarl-shared-runs-")))
    return _ROOT[0]


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def resolved(config: str, overrides: list[str]):
    from megarl.config import load_config

    return load_config(config, overrides)


def run_key(config: str, overrides: list[str], nproc: int) -> str:
    """What the run computes: its resolved config (without trainer.run_dir) and its process count
    (0, a plain process, and 1, torchrun of one, compute the same run)."""
    from megarl.config.loader import to_dict

    tree = to_dict(resolved(config, overrides))
    tree["trainer"].pop("run_dir")
    return _digest({"config": tree, "processes": max(nproc, 1)})


def tiny_model_dir(make_tiny) -> Path:
    """Where the session keeps the tiny random model of these `model.make_tiny` settings (a dataclass)."""
    return inputs_root() / "models" / _digest(dataclasses.asdict(make_tiny))


def once(key: str, make: Callable[[Path], None]) -> Path:
    """The run directory of run `key`: `make(run_dir)` runs it the first time it is asked for."""
    if key not in _RUNS:
        run_dir = inputs_root() / "runs" / key
        try:
            make(run_dir)
            _RUNS[key] = run_dir
        except BaseException as err:  # pytest.fail's Failed is a BaseException
            _RUNS[key] = err
            raise
    got = _RUNS[key]
    if isinstance(got, BaseException):
        raise got
    return got


def cleanup() -> None:
    _RUNS.clear()
    for root in _ROOT:
        shutil.rmtree(root, ignore_errors=True)
    _ROOT.clear()
