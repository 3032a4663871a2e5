"""Reference runs shared by resolved config (tests/shared_runs.py): the key is what the run computes,
not how its overrides are spelled; a run is made once per session, a failed one fails again at once."""
from __future__ import annotations

import pytest

import shared_runs

CONFIG = "configs/tiny_cpu.yaml"


def key(overrides: list[str], nproc: int = 0) -> str:
    return shared_runs.run_key(CONFIG, overrides, nproc)


def test_the_key_is_the_resolved_config_not_its_spelling():
    default_epochs = shared_runs.resolved(CONFIG, []).actor.ppo_epochs
    base = key(["trainer.total_steps=2", "algorithm.adv_estimator=gae"])
    assert key(["algorithm.adv_estimator=gae", "trainer.total_steps=2"]) == base  # another order
    assert key(["trainer.total_steps=2", "algorithm.adv_estimator=gae", f"actor.ppo_epochs={default_epochs}"]) == base  # a default repeated
    assert key(["trainer.total_steps=2", "algorithm.adv_estimator=gae", "trainer.run_dir=/elsewhere"]) == base  # where it writes
    assert key(["trainer.total_steps=2", "algorithm.adv_estimator=gae"], nproc=1) == base  # torchrun of one = one process


def test_what_changes_the_run_changes_the_key():
    base = key(["trainer.total_steps=2"])
    assert key(["trainer.total_steps=3"]) != base
    assert key(["trainer.total_steps=2", "actor.optim.lr=2e-3"]) != base
    assert key(["trainer.total_steps=2"], nproc=2) != base
    assert key(["trainer.total_steps=2", "model.path=/another/model"]) != base


def test_each_tiny_model_setting_has_its_own_directory():
    default = shared_runs.resolved(CONFIG, []).model.make_tiny
    six = shared_runs.resolved(CONFIG, ["model.make_tiny.layers=6"]).model.make_tiny
    assert shared_runs.tiny_model_dir(default) == shared_runs.tiny_model_dir(shared_runs.resolved(CONFIG, []).model.make_tiny)
    assert shared_runs.tiny_model_dir(six) != shared_runs.tiny_model_dir(default)


def test_a_run_is_made_once_and_a_failed_one_fails_again_without_running():
    made = []

    def make(run_dir):
        made.append(run_dir)
        run_dir.mkdir(parents=True)

    first = shared_runs.once("test-shared-runs-ok", make)
    assert shared_runs.once("test-shared-runs-ok", make) == first and made == [first] and first.is_dir()

    def fail(run_dir):
        made.append("failed")
        pytest.fail("the reference run exited 1")

    for _ in range(2):
        with pytest.raises(pytest.fail.Exception, match="the reference run exited 1"):
            shared_runs.once("test-shared-runs-failed", fail)
    assert made.count("failed") == 1
