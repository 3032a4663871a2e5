"""What changed between a run's last segment and the one resuming it, and whether that is allowed.

Resume is exact: a resumed run logs the same numbers as one that never stopped. That holds only
if the config that shapes the computation is unchanged (learning rate, model, layout, world size,
even total_steps, which the cosine schedule is computed from). A changed value is shown, and one
that breaks exactness is refused unless the user says so (trainer.resume_allow_changes=true).
Each segment's resolved config is kept: `<run_dir>/config_history/step_XXXXXXXX.yaml`, named by
the first step the segment runs, next to the latest in `<run_dir>/config.yaml`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from megarl.config.loader import flatten
from megarl.config.schema import Config

HISTORY_DIR = "config_history"
WORLD_SIZE_KEY = "launch.world_size"  # not a config key: the process count, recorded with each segment

# Keys a resumed run may change without changing any number it computes.
EXACTNESS_SAFE = (
    "tracking.",  # where and how metrics are reported
    "trainer.log_every", "trainer.save_every_steps", "trainer.keep_last_checkpoints", "trainer.resume",
    "trainer.resume_allow_changes", "rollout.verify_weights", "trainer.run_dir",
    "trainer.profile_steps", "trainer.profiler",  # the profiler records; it computes nothing
)


class ResumeChangeError(ValueError):
    """A resumed run changes settings that break exact resume, without trainer.resume_allow_changes."""


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) for every flat key whose value differs (missing = None), sorted."""
    keys = sorted(set(old) | set(new))
    return [(k, old.get(k), new.get(k)) for k in keys if _norm(old.get(k)) != _norm(new.get(k))]


def breaks_exactness(key: str, new: Mapping[str, Any] | None = None) -> bool:
    """Whether changing `key` changes what the resumed run computes. total_steps only matters
    through a learning-rate schedule that spans it (cosine, linear); constant ones ignore it."""
    if key.startswith("hub.") and key.endswith(".snapshot"):
        return False  # the same hub commit read from another cache directory: same files
    if key == "trainer.total_steps" and new is not None:
        return any(new.get(f"{role}.optim.schedule", "constant") != "constant" for role in ("actor", "critic"))
    return not any(key == safe or (safe.endswith(".") and key.startswith(safe)) for safe in EXACTNESS_SAFE)


def check_resume(run_dir: str | Path, new_flat: Mapping[str, Any], world_size: int, allow: bool) -> list[str]:
    """Compare with the last segment's config; returns lines describing each change (empty when
    nothing changed or there is no earlier segment). Raises ResumeChangeError for changes that break
    exactness when `allow` is false, listing them and the way to accept them."""
    last = _last_segment(Path(run_dir))
    if last is None:
        return []
    new = {**new_flat, WORLD_SIZE_KEY: world_size}
    # A key the last segment never recorded was added to megarl since; at its default it keeps the
    # behaviour the segment ran with (new features default off), so it is no change.
    defaults = _schema_defaults()
    changes = [(k, a, b) for k, a, b in config_changes(last, new)
               if not (k not in last and k in defaults and _norm(b) == _norm(defaults[k]))]
    lines = [f"{k}: {_show(a)} -> {_show(b)}" + ("" if breaks_exactness(k, new) else " (does not change results)")
             for k, a, b in changes]
    breaking = [f"{k}: {_show(a)} -> {_show(b)}" for k, a, b in changes if breaks_exactness(k, new)]
    if breaking and not allow:
        raise ResumeChangeError(
            f"resuming {run_dir} with changed settings ({'; '.join(breaking)}): the resumed run would not reproduce "
            f"the one it continues. Undo the changes, or accept them with trainer.resume_allow_changes=true")
    return lines


def record_segment(run_dir: str | Path, flat: Mapping[str, Any], resolved_yaml: str, start_step: int, world_size: int) -> Path:
    """Keep this segment's resolved config (and its world size) under config_history/; rank 0."""
    history = Path(run_dir) / HISTORY_DIR
    history.mkdir(parents=True, exist_ok=True)
    path = history / f"step_{start_step:08d}.yaml"
    path.write_text(f"# {WORLD_SIZE_KEY}: {world_size}\n" + resolved_yaml)
    (history / f"step_{start_step:08d}.json").write_text(json.dumps({**flat, WORLD_SIZE_KEY: world_size}, default=str))
    return path


def _schema_defaults() -> dict[str, Any]:
    return flatten(Config())


def _last_segment(run_dir: Path) -> dict | None:
    history = run_dir / HISTORY_DIR
    segments = sorted(history.glob("step_*.json")) if history.is_dir() else []
    if not segments:
        return None
    return json.loads(segments[-1].read_text())


def _norm(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))  # tuples vs lists, paths vs strings


def _show(value: Any) -> str:
    return "(unset)" if value is None else json.dumps(value, default=str)
