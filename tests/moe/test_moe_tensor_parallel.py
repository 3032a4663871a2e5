"""MoE training at parallel.tp > 1 runs with sequence parallelism (megarl's default at tp > 1) and
gives the expert and router gradients of tp1; without it (parallel.sequence_parallel=false) it is
refused (megarl.layout.refuse_moe_tensor_parallel), and why: Megatron-Core's MoE layer refuses to
train at tp > 1 without sequence parallelism, and with that guard lifted every expert gradient comes
out exactly tp times too large."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import REPO, make_model, torchrun
from megarl.config import ConfigError, load_config
from megarl.config.inputs import check_model_layout

sys.path.insert(0, str(REPO / "tests" / "capacity"))
from hf_configs import QWEN3_235B  # noqa: E402

FIX = "set parallel.sequence_parallel=true (the default)"


def test_moe_model_at_tp2_needs_sequence_parallelism(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_235B))
    base = [f"model.path={tmp_path}", "data.train_files=[t.parquet]"]
    check_model_layout(load_config(None, base + ["parallel.tp=2", "parallel.ep=8"]))  # the default: sequence parallelism
    with pytest.raises(ConfigError, match="parallel.tp = 2 with .*qwen3_moe mixture-of-experts model and "
                                          "parallel.sequence_parallel=false") as err:
        check_model_layout(load_config(None, base + ["parallel.tp=2", "parallel.ep=8", "parallel.sequence_parallel=false"]))
    assert FIX in str(err.value) and "\n" not in str(err.value)
    check_model_layout(load_config(None, base + ["parallel.ep=8", "parallel.sequence_parallel=false"]))  # tp1: nothing to split
    # a tiny MoE still to be made (no config.json yet) is refused the same way
    tiny = [f"model.path={tmp_path / 'not_yet'}", "data.train_files=[t.parquet]", "model.make_tiny.enable=true",
            "model.make_tiny.arch=qwen3_moe"]
    with pytest.raises(ConfigError, match="parallel.tp = 2 with a tiny qwen3_moe"):
        check_model_layout(load_config(None, tiny + ["parallel.tp=2", "parallel.sequence_parallel=false"]))
    check_model_layout(load_config(None, tiny + ["parallel.tp=2"]))


def test_launch_exits_2_for_moe_at_tp2_without_sequence_parallelism(tmp_path):
    proc = torchrun(0, ["launch/ppo.py", "--config", "configs/tiny_cpu.yaml", f"model.path={tmp_path / 'm'}",
                        "model.make_tiny.arch=qwen3_moe", "parallel.tp=2", "parallel.sequence_parallel=false"],
                    timeout=120, env={"WORLD_SIZE": "2"}, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and FIX in lines[0], proc.stderr


@pytest.mark.multiprocess
def test_tp2_with_sequence_parallelism_gives_the_expert_and_router_gradients_of_tp1(tmp_path):
    model = make_model(tmp_path / "moe", "qwen3_moe", vocab_size=301, layers=2, seed=5)
    out = tmp_path / "tp_train.pt"
    torchrun(2, ["tests/moe/tp_train_worker.py", "--model", str(model), "--out", str(out)], timeout=300)
    r = torch.load(out, weights_only=False)
    assert "without also enabling sequence parallelism" in r["error"]  # Megatron-Core's guard, still there
    ep2, sp, lifted = r["ep2"], r["tp2_ep2_etp1_sp"], r["tp2_ep2_etp1_lifted"]
    assert sp["grad_norms"] == pytest.approx(ep2["grad_norms"], rel=1e-5)
    # fc1 and fc2 of experts 0 and 1, and both layers' routers
    assert len(ep2["grads"]) == 6 and ep2["grads"].keys() == sp["grads"].keys() == lifted["grads"].keys()
    assert sum("router" in name for name in ep2["grads"]) == 2
    for name, grad in ep2["grads"].items():
        assert grad.norm() > 0, name
        torch.testing.assert_close(sp["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
        if "experts" in name:  # why parallel.sequence_parallel=false is refused for MoE at tp > 1
            torch.testing.assert_close(lifted["grads"][name], 2 * grad, rtol=1e-5, atol=1e-7, msg=name)
