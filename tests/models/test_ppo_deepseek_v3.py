"""launch/ppo.py trains a tiny DeepSeek-V3 (MLA, dense first layer, sigmoid group-limited routing with
the frozen correction bias, shared expert, MTP layer in the checkpoint) and logs the metrics of one
process (1e-3) at ep2 and at pp2 with uneven stages: 2 PPO steps with GAE and the critic."""
from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "trainer"))
from ppo_helpers import launch_ok, read_metrics, reference_run, shared_overrides  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

# tests/trainer/test_ppo_runs.py's comparison: the logged metrics that depend on every layer.
COMPARED = ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/ppo_kl", "actor/grad_norm",
            "critic/grad_norm", "critic/returns/mean", "actor/entropy", "critic/values/mean")
RUN = {"trainer.total_steps": 2, "model.make_tiny.enable": "false"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megarl.tools.make_tiny_model import make_tiny_model

    path = tmp_path_factory.mktemp("deepseek_v3") / "model"
    make_tiny_model("deepseek_v3", path, tokenizer="digits", layers=4, experts=8, groups=2, topk_group=1, topk=2,
                    max_positions=64, mtp_layers=1)
    return path


@pytest.fixture
def single_run(model):
    """The one-process run, once per session (tests/shared_runs.py)."""
    return reference_run(0, **RUN, **{"model.path": model})


@pytest.mark.parametrize("layout", [{"parallel.ep": 2}, {"parallel.pp": 2, "parallel.first_stage_layers": 1}],
                         ids=["ep2", "pp2_uneven"])
def test_deepseek_v3_ppo_same_metrics_under_layouts(model, single_run, tmp_path, layout):
    launch_ok(2, shared_overrides(tmp_path / "run", **RUN, **layout, **{"model.path": model}))
    single, parallel = read_metrics(single_run), read_metrics(tmp_path / "run")
    assert len(single) == len(parallel) == 2
    for a, b in zip(single, parallel):
        for k in COMPARED:
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-9), f"step {a['step']} {k}: {a[k]} vs {b[k]}"
