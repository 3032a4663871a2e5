"""DAPO batch shaping in launch/ppo.py runs of the tiny demo (GRPO, 8 prompts x 4 samples): at the
random start most groups score all 0 and are dropped; every trained group has a score spread;
dp2 (with a third rank generating for both, separate placement) trains exactly what one process trains; too few rounds end the run with one error line."""
from __future__ import annotations

import pytest

from ppo_helpers import launch, launch_ok, read_metrics, reference_run, shared_overrides
from test_ppo_runs import COMPARED, _assert_close

pytestmark = [pytest.mark.slow]

SHAPED = {"algorithm.adv_estimator": "grpo", "algorithm.filter_groups.enable": "true",
          "algorithm.filter_groups.max_num_gen_batches": 10, "reward.overlong_buffer.len": 1,
          "reward.overlong_buffer.penalty_factor": 0.1, "trainer.total_steps": 2}
FILTER_METRICS = ("train/num_gen_batches", "train/num_groups_kept", "train/num_groups_dropped", "train/num_groups_unused",
                  "train/uniform_groups", "reward/overlong_penalised")


@pytest.fixture
def filtered_single():
    """The one-process run, once per session (tests/shared_runs.py)."""
    return reference_run(0, **SHAPED)


def test_every_trained_group_has_a_score_spread(filtered_single):
    rows = read_metrics(filtered_single)
    assert len(rows) == 2
    for r in rows:
        assert r["train/uniform_groups"] == 0  # counted on the trained batch's scores, apart from the filter
        assert r["train/num_groups_kept"] == 8
        # each round is one step's worth of prompts: generated = rounds x 8 = kept + dropped + unused
        assert r["train/num_gen_batches"] * 8 == r["train/num_groups_kept"] + r["train/num_groups_dropped"] + r["train/num_groups_unused"]
        assert r["reward/overlong_penalised"] > 0  # 4-token responses (3 digits + eos) lose 0.1
    # the random start gives many all-zero groups: the filter had work to do
    assert sum(r["train/num_groups_dropped"] for r in rows) > 0 and max(r["train/num_gen_batches"] for r in rows) > 1


@pytest.mark.multiprocess
def test_dp2_trains_what_one_process_trains(filtered_single, tmp_path):
    """2 training ranks (dp2) and a third that generates for both (rollout.placement=separate, K = 0):
    the rounds come from the rollout rank, the groups are shared over the DP group."""
    launch_ok(3, shared_overrides(tmp_path / "dp2", **SHAPED, **{"rollout.placement": "separate", "rollout.num_ranks": 1}))
    single, dp2 = read_metrics(filtered_single), read_metrics(tmp_path / "dp2")
    compared = tuple(k for k in COMPARED if k in single[0])  # GRPO: no critic
    assert len(single) == len(dp2) == 2
    _assert_close(single, dp2, rel=1e-3, keys=compared + FILTER_METRICS)


def test_too_few_groups_is_one_error_naming_the_knob(tmp_path):
    # one round of 8 prompts from the random start: fewer than 8 groups have a spread
    proc = launch(0, shared_overrides(tmp_path / "short", **{**SHAPED, "algorithm.filter_groups.max_num_gen_batches": 1}))
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "raise algorithm.filter_groups.max_num_gen_batches (now 1)" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
