"""launch/ppo.py under the layouts of issue 14 logs the metrics of one process (1e-3): 2 GRPO steps
(PPO loss, KL loss to the reference, packed micro-batches) of a tiny 6-layer llama at vpp2 x pp2
(interleaved 1F1B) with uneven stages (2 layers on the first, 4 on the last): one launch for both
mechanisms, which tests/layouts/test_layouts.py and test_engine_layouts.py also check apart.
(tests/trainer runs GAE with the critic.) A small micro-batch token budget gives each mini-batch several
micro-batches, an odd count included, so the interleaved schedule runs filler micro-batches too."""
from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "trainer"))
from ppo_helpers import launch_ok, read_metrics, small_run_overrides  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

SIX_LAYERS = {"model.make_tiny.layers": 6, "trainer.total_steps": 2, "algorithm.adv_estimator": "grpo",
               "actor.use_kl_loss": "true", "actor.ppo_epochs": 1, "actor.max_tokens_per_microbatch": 48}


# tests/trainer/test_ppo_runs.py's comparison: the logged metrics that depend on every layer.
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "actor/entropy", "actor/kl_loss")


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("six_layer_runs")
    launch_ok(0, small_run_overrides(root, root / "single", **SIX_LAYERS))
    return root


def test_same_run_at_vpp2_pp2_with_uneven_stages(single_run):
    layout = {"parallel.pp": 2, "parallel.vpp": 2, "parallel.first_stage_layers": 2}
    proc = launch_ok(2, small_run_overrides(single_run, single_run / "vpp2_uneven", **SIX_LAYERS, **layout))
    assert "pp=2 vpp=2 first_stage_layers=2" in proc.stdout  # the layout ran
    single, parallel = read_metrics(single_run / "single"), read_metrics(single_run / "vpp2_uneven")
    assert len(single) == len(parallel) == 2
    for a, b in zip(single, parallel):
        for k in COMPARED:
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-9), f"step {a['step']} {k}: {a[k]} vs {b[k]}"
