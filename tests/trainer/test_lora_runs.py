"""2-step PPO with LoRA through the trainer (issue 26): GAE with a LoRA critic, and GRPO with the KL
loss to the reference (the actor with its adapters off), log one process's metrics (1e-3) at tp2
(sequence parallelism on), pp2 and dp2 (with every offload on); GAE on a MoE model (qwen3_moe, adapters
on the experts too) at tp2 x ep2 (expert tp 1: the two ranks hold different experts and split attention)
logs its one-process metrics too. Two launches: the one-process runs in one plain process, the layout runs
in one torchrun of 2 ranks (tests/trainer/runs_worker.py)."""
from __future__ import annotations

import json

import pytest

from ppo_helpers import read_metrics, small_run_overrides
from conftest import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

LORA = {"actor.lora.rank": 4, "actor.lora.alpha": 8, "critic.lora.rank": 4, "critic.lora.alpha": 8,
        "actor.optim.lr": 5e-3, "critic.optim.lr": 5e-3, "trainer.total_steps": 2,
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
    def layout(lay: str) -> dict:
        if lay.startswith("moe"):  # made on the first start (the one-process launch runs first)
            return {"model.path": root / "moe", "model.make_tiny.arch": "qwen3_moe", **(MOE_LAYOUT if lay == "moe_tp2ep2" else {})}
        return LAYOUTS.get(lay, {})

    return [small_run_overrides(root, root / f"{est}_{lay}", **LORA, **ESTIMATORS[est], **layout(lay)) for est, lay in names]


def test_lora_ppo_logs_the_same_metrics_under_every_layout(tmp_path):
    single = [(est, "single") for est in ESTIMATORS] + [("gae", "moe_single")]
    parallel = [(est, lay) for est in ESTIMATORS for lay in LAYOUTS] + [("gae", "moe_tp2ep2")]
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
