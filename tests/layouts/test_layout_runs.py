"""launch/ppo.py under the layouts of issue 14 logs the metrics of one process (1e-3): 2 PPO steps
(GAE, critic, packed micro-batches) of a tiny 4-layer llama at pp2 with uneven stages and at
vpp2 x pp2 (interleaved 1F1B). A small micro-batch token budget gives each mini-batch several
micro-batches, an odd count included, so the interleaved schedule runs filler micro-batches too."""
from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "trainer"))
from ppo_helpers import launch_ok, read_metrics, small_run_overrides  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

FOUR_LAYERS = {"model.make_tiny.layers": 4, "trainer.total_steps": 2,
               "actor.max_tokens_per_microbatch": 48, "critic.max_tokens_per_microbatch": 48}


# tests/trainer/test_ppo_runs.py's comparison: the logged metrics that depend on every layer.
COMPARED = ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/ppo_kl", "actor/grad_norm",
            "critic/grad_norm", "critic/returns/mean", "actor/entropy", "critic/values/mean")


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("four_layer_runs")
    launch_ok(0, small_run_overrides(root, root / "single", **FOUR_LAYERS))
    return root


@pytest.mark.parametrize("layout", [{"parallel.pp": 2, "parallel.first_stage_layers": 1},
                                    {"parallel.pp": 2, "parallel.vpp": 2}], ids=["pp2_uneven", "vpp2_pp2"])
def test_same_run_under_issue_14_layouts(single_run, layout):
    name = "_".join(f"{k.split('.')[-1]}{v}" for k, v in layout.items())
    proc = launch_ok(2, small_run_overrides(single_run, single_run / name, **FOUR_LAYERS, **layout))
    assert ("vpp=2" if "parallel.vpp" in layout else "first_stage_layers=1") in proc.stdout  # the layout ran
    single, parallel = read_metrics(single_run / "single"), read_metrics(single_run / name)
    assert len(single) == len(parallel) == 2
    for a, b in zip(single, parallel):
        for k in COMPARED:
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-9), f"step {a['step']} {k}: {a[k]} vs {b[k]}"
