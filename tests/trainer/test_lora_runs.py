"""2-step PPO with LoRA through the trainer (issue 26): GAE with a LoRA critic, and GRPO with the KL
loss to the reference (the actor with its adapters off), log one process's metrics (1e-3) at tp2
(sequence parallelism on), pp2 and dp2 (with every offload on); GAE on a MoE model (qwen3_moe, adapters
on the experts too) at tp2 x ep2 (expert tp 1: the two ranks hold different experts and split attention)
logs its one-process metrics too. Two launches: the one-process runs in one plain process, the layout runs
in one torchrun of 2 ranks (tests/trainer/runs_worker.py).

Each launch also saves a run at step 1 and resumes it for step 2 (GRPO at one process, the MoE GAE run at
tp2 x ep2): the resumed run logs bitwise what the straight 2-step run logs, from checkpoints that hold the
adapters, the critic's value head and their optimizer state, and no base weight (megarl.engine.adapter_checkpoint)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from ppo_helpers import launch, read_metrics, small_run_overrides
from conftest import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

# Constant LR: the cosine schedule spans trainer.total_steps, so the resumed runs' 1-step first segment
# would otherwise run another schedule than the 2-step runs it is compared with.
LORA = {"actor.lora.rank": 4, "actor.lora.alpha": 8, "critic.lora.rank": 4, "critic.lora.alpha": 8,
        "actor.optim.lr": 5e-3, "critic.optim.lr": 5e-3, "trainer.total_steps": 2,
        "actor.optim.schedule": "constant", "critic.optim.schedule": "constant",
        "tracking.loggers": "[jsonl]"}  # no MLflow store to create eight times
ESTIMATORS = {
    "gae": {"algorithm.adv_estimator": "gae"},
    "grpo": {"algorithm.adv_estimator": "grpo", "actor.use_kl_loss": "true", "actor.kl_loss_coef": 0.1},
}
# dp2 also offloads the actor's and critic's whole training state between phases: the numbers must not
# change, and nothing may stay behind for the rollout (the frozen base lives outside DDP's buffer).
OFFLOAD_ALL = {f"{role}.{part}_offload": "true" for role in ("actor", "critic") for part in ("param", "grad", "optimizer")}
LAYOUTS = {"tp2": {"parallel.tp": 2}, "pp2": {"parallel.pp": 2}, "dp2": OFFLOAD_ALL}
MOE_LAYOUT = {"parallel.tp": 2, "parallel.ep": 2, "parallel.etp": 1}  # 2 ranks: ep folds over tp (Megatron's ep x etp = tp x dp)
COMPARED = {
    "gae": ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "actor/entropy",
            "critic/vf_loss", "critic/grad_norm", "critic/returns/mean"),
    "grpo": ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "actor/entropy", "actor/kl_loss"),
}


def _runs(root, names: list[tuple[str, str]]) -> list[list[str]]:
    """The runs' overrides; a name (est, "<layout>_resumed") is two runs in one run_dir: step 1, saved,
    then step 2 from that checkpoint."""
    def layout(lay: str) -> dict:
        if lay.startswith("moe"):  # made on the first start (the one-process launch runs first)
            return {"model.path": root / "moe", "model.make_tiny.arch": "qwen3_moe", **(MOE_LAYOUT if lay == "moe_tp2ep2" else {})}
        return LAYOUTS.get(lay, {})

    runs = []
    for est, lay in names:
        base = lay.removesuffix("_resumed")
        segments = ({"trainer.total_steps": 1}, {}) if lay != base else ({},)
        saved = {"trainer.save_every_steps": 1} if lay != base else {}
        runs += [small_run_overrides(root, root / f"{est}_{lay}", **{**LORA, **ESTIMATORS[est], **layout(base), **saved, **seg})
                 for seg in segments]
    return runs


def _assert_adapters_only(role_dir: Path, base_bytes: int) -> None:
    """Every tensor of the checkpoint is an adapter, a value head or their optimizer state, and the
    whole directory is well below a full checkpoint's weights + Adam moments (3 x the float32 base)."""
    keys = list(FileSystemReader(str(role_dir)).read_metadata().state_dict_metadata)
    assert keys and all(".lora." in k or "output_layer" in k for k in keys if "model." in k), keys
    assert (role_dir / "base_ref.json").is_file()
    stored = sum(f.stat().st_size for f in role_dir.rglob("*") if f.is_file())
    assert stored < 0.5 * 3 * base_bytes, (role_dir, stored, base_bytes)


def test_lora_ppo_logs_the_same_metrics_under_every_layout(tmp_path):
    single = [(est, "single") for est in ESTIMATORS] + [("gae", "moe_single"), ("grpo", "single_resumed")]
    parallel = [(est, lay) for est in ESTIMATORS for lay in LAYOUTS] + [("gae", "moe_tp2ep2"), ("gae", "moe_tp2ep2_resumed")]
    for nproc, names in ((0, single), (2, parallel)):
        spec = tmp_path / f"runs_{nproc}.json"
        spec.write_text(json.dumps(_runs(tmp_path, names)))
        torchrun(nproc, ["tests/trainer/runs_worker.py", "--config", "configs/tiny_cpu.yaml", "--runs", str(spec)],
                 timeout=1200)
    for est in ESTIMATORS:
        base = read_metrics(tmp_path / f"{est}_single")
        assert len(base) == 2
        # the adapters train (B moves off zero in step 1): step 2's policy is not step 1's
        assert base[1]["actor/grad_norm"] > 0 and base[1]["actor/entropy"] != base[0]["actor/entropy"]
        # under LoRA the gradients and Adam state are the adapters' (a few percent of the model here)
        assert base[1]["memory/actor/grad_bytes"] < 0.2 * base[1]["memory/actor/param_bytes"]
        if est == "grpo":
            assert base[1]["actor/kl_loss"] > 0  # the reference (adapters off) stayed behind the adapted actor
        for lay in LAYOUTS:
            runs = read_metrics(tmp_path / f"{est}_{lay}")
            if lay == "dp2":
                assert all(r["memory/resident_gb/gen"] == 0 < r["perf/offload_bytes"] for r in runs), est
            for a, b in zip(base, runs, strict=True):
                for k in COMPARED[est]:
                    assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-9), f"{est} {lay} step {a['step']} {k}: {a[k]} vs {b[k]}"
    moe, moe_tp2ep2 = read_metrics(tmp_path / "gae_moe_single"), read_metrics(tmp_path / "gae_moe_tp2ep2")
    assert len(moe) == 2 and moe[1]["actor/grad_norm"] > 0 and moe[1]["actor/entropy"] != moe[0]["actor/entropy"]
    for a, b in zip(moe, moe_tp2ep2, strict=True):
        for k in COMPARED["gae"]:
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-9), f"moe tp2 x ep2 step {a['step']} {k}: {a[k]} vs {b[k]}"

    # Saved at step 1, resumed for step 2: bitwise the straight run's metrics; the checkpoints hold no base weight.
    for est, lay, roles in (("grpo", "single", ("actor",)), ("gae", "moe_tp2ep2", ("actor", "critic"))):
        straight, resumed = read_metrics(tmp_path / f"{est}_{lay}"), read_metrics(tmp_path / f"{est}_{lay}_resumed")
        assert [r["step"] for r in resumed] == [1, 2]
        for a, b in zip(straight, resumed, strict=True):
            for k in COMPARED[est]:
                assert b[k] == a[k], f"{est} {lay} resumed, step {a['step']} {k}: {a[k]} vs {b[k]}"
        model = tmp_path / ("moe" if lay.startswith("moe") else "model")
        base_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        for role in roles:
            _assert_adapters_only(tmp_path / f"{est}_{lay}_resumed" / "checkpoints" / "step_00000001" / role, base_bytes)

    # export_hf on an adapter-only checkpoint finds the base through base_ref.json (the run's config is
    # not read for it): the merged model (default) and the PEFT adapter on that base give one policy
    _check_exports(tmp_path, tmp_path / "grpo_single_resumed" / "checkpoints" / "step_00000002")
    _check_changed_base_refused(tmp_path)


def _check_exports(root: Path, ckpt: Path) -> None:
    import shutil

    import torch
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    import yaml

    config = ckpt.parent.parent / "config.yaml"  # model.path gone: the base can only come from base_ref.json
    run_config = yaml.safe_load(config.read_text())
    run_config["model"]["path"] = str(root / "no_such_model")
    config.write_text(yaml.safe_dump(run_config))
    torchrun(0, ["-m", "megarl.tools.export_hf", "--ckpt", str(ckpt), "--out", str(root / "merged")])
    torchrun(0, ["-m", "megarl.tools.export_hf", "--ckpt", str(ckpt), "--out", str(root / "peft"), "--adapter-only"])
    base = AutoModelForCausalLM.from_pretrained(root / "model", torch_dtype=torch.float32)
    tokens = torch.randint(0, base.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(tokens).logits.log_softmax(-1)
        merged = AutoModelForCausalLM.from_pretrained(root / "merged", torch_dtype=torch.float32)(tokens).logits.log_softmax(-1)
        adapted = PeftModel.from_pretrained(base, root / "peft").eval()(tokens).logits.log_softmax(-1)
    assert (merged - plain).abs().max() > 1e-4  # two steps of adapters moved the policy
    assert (merged - adapted).abs().max() < 1e-4

    # --model naming another base (one tensor changed) is refused: the adapters were trained on the recorded one
    other = root / "other_base"
    shutil.copytree(root / "model", other)
    tensors = load_file(other / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] * 2
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    refused = torchrun(0, ["-m", "megarl.tools.export_hf", "--ckpt", str(ckpt), "--out", str(root / "refused"),
                           "--model", str(other)], check=False)
    assert refused.returncode == 2 and "holds LoRA adapters trained on the base model" in refused.stderr, refused.stderr
    assert not (root / "refused").exists()


def _check_changed_base_refused(root: Path) -> None:
    """The base at model.path overwritten (one tensor changed) under a run with LoRA checkpoints: resuming
    is refused in one line, before any model is built, exit 2 (megarl.run.Run)."""
    from safetensors.torch import load_file, save_file

    weights = root / "model" / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[-1]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, weights, metadata={"format": "pt"})
    run_dir = root / "grpo_single_resumed"
    proc = launch(0, small_run_overrides(root, run_dir, **{**LORA, **ESTIMATORS["grpo"], "trainer.save_every_steps": 1,
                                                           "trainer.total_steps": 3}))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "holds LoRA adapters trained on the base model" in ln]
    assert len(lines) == 1 and str(run_dir / "checkpoints" / "step_00000002" / "actor") in lines[0], proc.stderr
    assert "set model.path to the original base weights" in lines[0] and "resumed from" not in proc.stdout
