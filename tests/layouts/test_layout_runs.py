"""launch/ppo.py under the layouts of issue 14 logs the metrics of one process (1e-3): 2 GRPO steps
(PPO loss, KL loss to the reference, packed micro-batches) of a tiny 6-layer llama at vpp2 x pp2
(interleaved 1F1B) with uneven stages (2 layers on the first, 4 on the last): one launch for both
mechanisms, which tests/layouts/test_layouts.py and test_engine_layouts.py also check apart; and the
same GRPO run at cp2 and at cp2 x tp2 with sequence parallelism (issue 23). (tests/trainer runs GAE with the critic.) A small micro-batch token budget gives each mini-batch several
micro-batches, an odd count included, so the interleaved schedule runs filler micro-batches too."""
from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "trainer"))
from ppo_helpers import launch_ok, read_metrics, reference_run, shared_overrides  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

SIX_LAYERS = {"model.make_tiny.layers": 6, "trainer.total_steps": 2, "algorithm.adv_estimator": "grpo",
               "actor.use_kl_loss": "true", "actor.ppo_epochs": 1, "actor.max_tokens_per_microbatch": 48}


# tests/trainer/test_ppo_runs.py's comparison: the logged metrics that depend on every layer.
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "actor/entropy", "actor/kl_loss")


@pytest.fixture
def single_run():
    """The one-process run, once per session (tests/shared_runs.py)."""
    return reference_run(0, **SIX_LAYERS)


# vpp2 x pp2 with uneven stages; and (issue 23) GRPO under context parallelism, alone (2 ranks) and
# with tensor and sequence parallelism (4 ranks) (tests/trainer/test_ppo_runs.py runs GAE with the critic at cp2 and
# cp2 x tp2): the old, reference and new log-probs, the KL loss and the entropy on each CP rank's
# share of every packed sequence, the losses scaled over dp x cp.
@pytest.mark.parametrize("nproc,layout,shown", [
    (2, {"parallel.pp": 2, "parallel.vpp": 2, "parallel.first_stage_layers": 2}, "pp=2 vpp=2 first_stage_layers=2"),
    (2, {"parallel.cp": 2}, "tp=1 pp=1 cp=2 dp=1"),
    (4, {"parallel.cp": 2, "parallel.tp": 2}, "tp=2 sp pp=1 cp=2 dp=1"),
], ids=["vpp2_pp2_uneven", "grpo_cp2", "grpo_cp2xtp2"])
def test_same_run_under_the_layout(single_run, tmp_path, nproc, layout, shown):
    proc = launch_ok(nproc, shared_overrides(tmp_path / "run", **SIX_LAYERS, **layout))
    assert shown in proc.stdout, proc.stdout  # the layout ran
    single, parallel = read_metrics(single_run), read_metrics(tmp_path / "run")
    assert len(single) == len(parallel) == 2
    for a, b in zip(single, parallel):
        for k in COMPARED:
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-9), f"step {a['step']} {k}: {a[k]} vs {b[k]}"
