"""Resuming with a changed config (issue 11, item 6): changes are shown, the ones that break exact
resume are refused unless trainer.resume_allow_changes=true, each segment's config is kept."""
from __future__ import annotations

import pytest

from megarl.config.resume_changes import ResumeChangeError, check_resume, record_segment

BASE = {"actor.optim.lr": 1e-6, "model.path": "/m/a", "tracking.mlflow": True, "trainer.total_steps": 10}


def test_a_first_segment_has_nothing_to_compare(tmp_path):
    assert check_resume(tmp_path, BASE, world_size=2, allow=False) == []


def test_unchanged_and_harmless_changes_resume(tmp_path):
    record_segment(tmp_path, BASE, "a: 1\n", start_step=1, world_size=2)
    assert check_resume(tmp_path, BASE, world_size=2, allow=False) == []
    lines = check_resume(tmp_path, {**BASE, "tracking.mlflow": False}, world_size=2, allow=False)
    assert lines == ["tracking.mlflow: true -> false (does not change results)"]


@pytest.mark.parametrize("change,shown", [
    ({"actor.optim.lr": 2e-6}, "actor.optim.lr: 1e-06 -> 2e-06"),
    ({"model.path": "/m/b"}, 'model.path: "/m/a" -> "/m/b"'),
    ({}, "launch.world_size: 2 -> 4"),
])
def test_changes_that_break_exactness_are_refused_unless_allowed(tmp_path, change, shown):
    record_segment(tmp_path, BASE, "a: 1\n", start_step=1, world_size=2)
    world = 4 if not change else 2
    with pytest.raises(ResumeChangeError, match="resume_allow_changes=true") as info:
        check_resume(tmp_path, {**BASE, **change}, world_size=world, allow=False)
    assert shown in str(info.value)
    assert check_resume(tmp_path, {**BASE, **change}, world_size=world, allow=True) == [shown]


def test_each_segment_keeps_its_resolved_config(tmp_path):
    record_segment(tmp_path, BASE, "actor: {lr: 1e-6}\n", start_step=1, world_size=2)
    record_segment(tmp_path, {**BASE, "actor.optim.lr": 2e-6}, "actor: {lr: 2e-6}\n", start_step=6, world_size=2)
    kept = sorted(p.name for p in (tmp_path / "config_history").glob("*.yaml"))
    assert kept == ["step_00000001.yaml", "step_00000006.yaml"]
    assert "2e-6" in (tmp_path / "config_history" / "step_00000006.yaml").read_text()
    # the next resume compares with the latest segment
    assert check_resume(tmp_path, {**BASE, "actor.optim.lr": 2e-6}, world_size=2, allow=False) == []


def test_total_steps_breaks_exactness_only_under_a_schedule_that_spans_it(tmp_path):
    cosine = {**BASE, "actor.optim.schedule": "cosine", "critic.optim.schedule": "constant"}
    constant = {**BASE, "actor.optim.schedule": "constant", "critic.optim.schedule": "constant"}
    record_segment(tmp_path / "a", cosine, "", start_step=1, world_size=1)
    with pytest.raises(ResumeChangeError, match="trainer.total_steps: 10 -> 20"):
        check_resume(tmp_path / "a", {**cosine, "trainer.total_steps": 20}, world_size=1, allow=False)
    record_segment(tmp_path / "b", constant, "", start_step=1, world_size=1)
    assert check_resume(tmp_path / "b", {**constant, "trainer.total_steps": 20}, world_size=1, allow=False) == [
        "trainer.total_steps: 10 -> 20 (does not change results)"]


def test_a_key_added_since_the_last_segment_is_no_change_at_its_default(tmp_path):
    # A run checkpointed by an older megarl has no record of keys added since; at their defaults
    # they keep its behaviour, so resuming it is not refused. Set to another value, they are a change.
    from megarl.config.loader import flatten
    from megarl.config.schema import Config

    full = {**flatten(Config()), "model.path": "m"}
    older = {k: v for k, v in full.items() if k != "rollout.top_k"}
    record_segment(tmp_path, older, "{}\n", start_step=0, world_size=2)
    assert check_resume(tmp_path, full, world_size=2, allow=False) == []
    changed = {**full, "rollout.top_k": 5}
    with pytest.raises(ResumeChangeError, match="rollout.top_k"):
        check_resume(tmp_path, changed, world_size=2, allow=False)
