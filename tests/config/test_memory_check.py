"""The start-up memory check of a colocated vLLM/SGLang engine (issue 22 item 6, audit F4), on CPU:
the device's memory and the CUDA probe are injected. Model sizes are public config.json files
(tests/capacity/hf_configs.py); the arithmetic is the planner's, so the estimate is compared with it."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO
from megarl.config import load_config
from megarl.capacity.memory_check import check_colocated_memory, estimate

sys.path.insert(0, str(REPO / "tests" / "capacity"))
from hf_configs import QWEN25_05B, QWEN25_7B  # noqa: E402

H200 = 141 * 2**30


def model_dir(tmp_path, config: dict):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return d


def run_config(model, *overrides):
    return load_config(None, [f"model.path={model}", "data.train_files=[unused]", "model.dtype=bfloat16",
                              "rollout.engine=vllm", *overrides])


def test_estimate_is_the_planners(tmp_path):
    from megarl.capacity import Cluster, Layout, RunShape, arch_from_config, plan
    from megarl.capacity.hardware import GPUS

    cfg = run_config(model_dir(tmp_path, QWEN25_7B), "algorithm.adv_estimator=gae", "actor.grad_offload=true",
                     "critic.grad_offload=true", "actor.optimizer_offload=true", "critic.optimizer_offload=true")
    est = estimate(cfg, 8, H200)
    report = plan(arch_from_config(QWEN25_7B), Layout(), RunShape(critic=True, ref=False, grad_offload=True,
                                                                  optimizer_offload="phases"), Cluster(8, 8, GPUS["h200-141gb"]))
    assert est.training_state / 2**30 == pytest.approx(report["memory_gib"]["rollout"]["training_state"], abs=1e-6)  # GiB, rounded
    # actor + critic bf16 parameters stay: 2 x 2 bytes x ~7.6e9
    assert 2 * 2 * 7.0e9 < est.training_state < 2 * 2 * 7.7e9


def test_small_model_fits_and_nothing_is_turned_on(tmp_path):
    cfg, note = check_colocated_memory(run_config(model_dir(tmp_path, QWEN25_05B), "algorithm.adv_estimator=grpo",
                                                   "rollout.samples_per_prompt=4"), 1, H200)
    assert note is None
    assert (cfg.actor.param_offload, cfg.actor.grad_offload, cfg.actor.optimizer_offload, cfg.ref.param_offload) == (False,) * 4


def test_offloads_left_null_are_turned_on_cheapest_first(tmp_path):
    # 7B GAE on one H200: actor alone ~137 GB with Adam moments + fp32 main params + fp32 grads;
    # with gradients and optimizer state offloaded, 2 x 15 GB of parameters + 0.5 x 141 + 4 fits.
    cfg, note = check_colocated_memory(run_config(model_dir(tmp_path, QWEN25_7B), "algorithm.adv_estimator=gae"), 1, H200)
    assert "turned on actor.grad_offload, actor.optimizer_offload, critic.grad_offload, critic.optimizer_offload" in note
    assert cfg.actor.grad_offload and cfg.actor.optimizer_offload and cfg.critic.grad_offload and cfg.critic.optimizer_offload
    assert cfg.actor.param_offload is False and cfg.critic.param_offload is False and cfg.ref.param_offload is False
    # an explicit setting is kept: the user's true stays, nothing else is needed then
    cfg2, note2 = check_colocated_memory(run_config(model_dir(tmp_path, QWEN25_7B), "algorithm.adv_estimator=gae",
                                                    "critic.param_offload=true"), 1, H200)
    assert cfg2.critic.param_offload is True and "critic.grad_offload" in note2
    # not CUDA (no device memory) or the hf engine: nothing to check, nulls are off
    for cfg3, device in ((run_config(model_dir(tmp_path, QWEN25_7B), "algorithm.adv_estimator=gae"), None),
                         (run_config(model_dir(tmp_path, QWEN25_7B), "algorithm.adv_estimator=gae", "rollout.engine=hf"), H200)):
        resolved, none = check_colocated_memory(cfg3, 1, device)
        assert none is None and resolved.actor.grad_offload is False


def test_explicit_false_is_not_overridden_and_the_run_stops_naming_the_knob(tmp_path):
    from megarl.config import ConfigError

    cfg = run_config(model_dir(tmp_path, QWEN25_7B), "algorithm.adv_estimator=gae", "actor.optimizer_offload=false")
    with pytest.raises(ConfigError) as err:
        check_colocated_memory(cfg, 1, H200)
    line = str(err.value)
    assert "\n" not in line and line.startswith("rollout.gpu_memory_utilization=0.5: the colocated vllm engine would not fit")
    assert "set actor.optimizer_offload=true" in line and "rollout.memory_check=false" in line


def test_launch_refuses_with_one_line_and_exit_2(tmp_path):
    """launch/ppo.py with a CUDA device of 141 GiB (injected) and a vllm package on the path
    (an empty stand-in: the check runs before any engine is imported)."""
    from megarl.data.prepare import prepare_arithmetic

    prepare_arithmetic(tmp_path, "copy", 3, 16, 4)
    model = model_dir(tmp_path, QWEN25_7B)
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("")
    script = tmp_path / "launch_on_fake_h200.py"
    script.write_text(textwrap.dedent(f"""
        import runpy, sys
        sys.path.insert(0, {str(REPO)!r})
        import megarl.capacity.memory_check as memory
        memory.cuda_total_bytes = lambda: {H200}  # fake: the platform probe of one H200
        sys.argv = ["launch/ppo.py", *sys.argv[1:]]
        runpy.run_path({str(REPO / "launch" / "ppo.py")!r}, run_name="__main__")
    """))
    overrides = [f"model.path={model}", f"data.train_files=[{tmp_path / 'train.parquet'}]", "data.val_files=[]",
                 "model.dtype=bfloat16", "rollout.engine=vllm", "algorithm.adv_estimator=gae",
                 "actor.grad_offload=false", "actor.optimizer_offload=false", f"trainer.run_dir={tmp_path / 'run'}"]
    env = {"PYTHONPATH": f"{tmp_path / 'site'}:{REPO}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(script), "--config", "configs/tiny_cpu.yaml", *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("config error")]
    assert len(lines) == 1 and "the colocated vllm engine would not fit" in lines[0], proc.stderr
    assert "set actor.grad_offload=true actor.optimizer_offload=true" in lines[0]
    assert not (tmp_path / "run").exists()  # stopped before anything was built


def test_delta_weight_sync_counts_its_copy(tmp_path):
    # train tp2 -> rollout tp1: each GPU receives the other half of every tp-split tensor and sends
    # its own, and delta keeps both (about the bf16 model: 2 x 7.6e9 / 2 x 2 bytes); full keeps none
    from megarl.capacity import Cluster, Layout, RunShape, arch_from_config, plan
    from megarl.capacity.hardware import GPUS

    model = model_dir(tmp_path, QWEN25_7B)
    full, delta = (estimate(run_config(model, "parallel.tp=2", "rollout.tp=1", f"rollout.weight_sync.mode={mode}"), 8, H200)
                   for mode in ("full", "delta"))
    report = plan(arch_from_config(QWEN25_7B), Layout(tp=2, rollout_tp=1), RunShape(weight_sync="delta"), Cluster(8, 8, GPUS["h200-141gb"]))
    assert full.weight_sync_copy == 0 and delta.total - full.total == delta.weight_sync_copy
    assert delta.weight_sync_copy == pytest.approx(2 * report["sync"]["megarl_bytes_per_gpu"])
    assert delta.weight_sync_copy / 2**30 == pytest.approx(report["memory_gib"]["rollout"]["weight_sync_copy"], abs=1e-6)
    assert 1.0e9 * 2 * 2 < delta.weight_sync_copy < 7.7e9 * 2
