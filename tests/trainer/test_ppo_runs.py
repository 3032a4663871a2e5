"""launch/ppo.py end to end: resume equals an uninterrupted run, layouts agree, the guards fire (the demo's
learning and tracking: tests/learning/test_demo_seeds.py)."""
from __future__ import annotations

import json

import pytest

from ppo_helpers import launch, launch_ok, read_metrics, reference_run, shared_overrides, small_run_overrides

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # torchrun, 2 ranks (one single-process run)

COMPARED = ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/ppo_kl", "actor/grad_norm",
            "critic/grad_norm", "actor/reward_kl_penalty", "critic/returns/mean", "actor/entropy")
# (not critic/advantages/mean: whitened advantages average to zero, so only rounding noise is left)

# The layout runs also train with TIS under nucleus sampling (issue 24, item 3): the rollout_corr/
# metrics appear, agree across layouts, and show an engine that agrees with the trainer (ratios 1 at
# float32 noise), which they do only because the ratio uses the untruncated log-probs: the processed
# ones would put log(kept mass) < 0 into every token's ratio.
CORRECTION = {"algorithm.rollout_correction.mode": "tis", "rollout.top_p": 0.9}


def layout_overrides(tp: int, pp: int, cp: int) -> dict:
    return {"trainer.total_steps": 2, "parallel.tp": tp, "parallel.pp": pp, "parallel.cp": cp}


def _assert_close(a: list[dict], b: list[dict], rel: float, keys=COMPARED) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for k in keys:
            assert rb[k] == pytest.approx(ra[k], rel=rel, abs=1e-9), f"step {ra['step']} {k}: {ra[k]} vs {rb[k]}"


def test_resume_equals_uninterrupted_run(tmp_path):
    # KL in the reward (adaptive controller) so that its state must survive the resume too.
    # Constant LR: the demo's cosine schedule spans trainer.total_steps, so a 2-step first half
    # would otherwise run a different schedule than the 4-step reference.
    extra = {"actor.optim.schedule": "constant", "critic.optim.schedule": "constant",
             "algorithm.use_kl_in_reward": "true", "algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.kl_coef": 0.05,
             "algorithm.kl_ctrl.target_kl": 0.01, "algorithm.kl_ctrl.horizon": 100}
    straight, split = tmp_path / "straight", tmp_path / "split"
    launch_ok(2, small_run_overrides(tmp_path, straight, **{"trainer.total_steps": 4}, **extra))
    launch_ok(2, small_run_overrides(tmp_path, split, **{"trainer.total_steps": 2, "trainer.save_every_steps": 2}, **extra))
    # A save killed half-way leaves a temporary directory: resume must ignore it.
    (split / "checkpoints" / "step_00000003.tmp-step3" / "actor").mkdir(parents=True)
    # A changed learning rate would make the resumed run differ from the straight one: refused (issue 11).
    # (one plain process: the refusal comes before any rank starts work)
    refused = launch(0, small_run_overrides(tmp_path, split, **{"trainer.total_steps": 4, "actor.optim.lr": 2e-3}, **extra))
    assert refused.returncode != 0 and refused.stderr.count("trainer.resume_allow_changes=true") == 1, refused.stderr
    proc = launch_ok(2, small_run_overrides(tmp_path, split, **{"trainer.total_steps": 4}, **extra))
    assert "resumed from" in proc.stdout and "step_00000002" in proc.stdout
    # total_steps under a constant schedule: shown, allowed; each segment's config kept
    assert "trainer.total_steps: 2 -> 4 (does not change results)" in proc.stdout
    assert sorted(p.name for p in (split / "config_history").glob("*.yaml")) == ["step_00000001.yaml", "step_00000003.yaml"]
    a, b = read_metrics(straight), read_metrics(split)
    assert len(a) == len(b) == 4
    _assert_close(a, b, rel=1e-6, keys=COMPARED + ("actor/reward_kl_penalty_coeff", "critic/values/mean"))
    assert a[3]["actor/reward_kl_penalty_coeff"] != a[0]["actor/reward_kl_penalty_coeff"]  # the controller moved
    assert not (split / "checkpoints" / "step_00000003.tmp-step3").exists()


OFFLOAD_ALL = {"ref.param_offload": "true",
               **{f"{role}.{part}_offload": "true" for role in ("actor", "critic") for part in ("param", "grad", "optimizer")}}


@pytest.mark.parametrize("nproc,tp,pp,cp", [(2, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 1), (2, 1, 1, 2), (4, 2, 1, 2)],
                         ids=["tp2", "pp2", "dp2", "cp2", "cp2xtp2"])
def test_same_run_under_every_layout(tmp_path_factory, nproc, tp, pp, cp, single_process_run):
    # dp2 also offloads everything between phases: numbers must not change, memory must.
    offload = OFFLOAD_ALL if (tp, pp) == (1, 1) else {}
    # cp2 x tp2 also saves after each step: its step-1 checkpoint resumes at dp2 below.
    resume_at_dp2 = (tp, cp) == (2, 2)
    save = {"trainer.save_every_steps": 1} if resume_at_dp2 else {}
    # tp2 -> rollout tp1 moves half the model: the tp2 run syncs by delta (rollout.weight_sync), which
    # must log what one process logs as every other layout does (it loads the same weights)
    delta = {"rollout.weight_sync.mode": "delta"} if (nproc, tp, pp, cp) == (2, 2, 1, 1) else {}
    # a shared run (tests/shared_runs.py): the tp2 one is also test_delta_sync_logs_what_full_sync_logs's
    run_dir = reference_run(nproc, **layout_overrides(tp, pp, cp), **offload, **save, **CORRECTION, **delta)
    stdout = (run_dir / "launch.log").read_text()
    # tp2 runs with sequence parallelism, the default at tp > 1 (the critic's value head on the SP
    # shard), under context parallelism too (cp2 x tp2: the SP shard of each CP rank's tokens)
    assert (f"tp={tp} sp " in stdout) == (tp > 1), stdout
    _assert_close(read_metrics(single_process_run), read_metrics(run_dir), rel=1e-3,
                  keys=COMPARED + ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_max"))
    for step in read_metrics(single_process_run) + read_metrics(run_dir):
        assert abs(step["rollout_corr/kl"]) < 1e-5 and step["rollout_corr/k3_kl"] < 1e-8
        assert step["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
        assert step["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
    if delta:
        first, second = read_metrics(run_dir)
        assert first["training/hybrid_sync_changed_fraction"] == 1.0  # the first sync is full, plus a header per segment
        assert 0 < first["training/hybrid_sync_full_bytes"] < first["training/hybrid_sync_bytes"] < first["training/hybrid_sync_full_bytes"] + 24 * 64
        # fp32 rollout: AdamW moves nearly every element, so most segments go whole, never more than that
        assert 0 < second["training/hybrid_sync_changed_fraction"] <= 1.0
        assert second["training/hybrid_sync_bytes"] < second["training/hybrid_sync_full_bytes"] + 24 * 64
        assert second["memory/weight_sync_copy_bytes"] == first["memory/weight_sync_copy_bytes"] > 0
    if resume_at_dp2:
        # A checkpoint written at cp2 x tp2 resumes at dp2 (2 processes, no tp, no cp; a fresh run
        # directory, so there is no earlier segment whose layout it would change): its step 2 logs
        # the straight runs' step 2 (this one's and one process's) within the layouts' 1e-3.
        resumed = tmp_path_factory.mktemp("resumed_dp2")
        proc = launch_ok(2, shared_overrides(resumed, **{"trainer.total_steps": 2,
                                                         "trainer.resume": run_dir / "checkpoints" / "step_00000001"},
                                             **CORRECTION))
        assert "resumed from" in proc.stdout and "step_00000001" in proc.stdout, proc.stdout
        after = read_metrics(resumed)
        assert [r["step"] for r in after] == [2]
        for straight in (run_dir, single_process_run):
            _assert_close(read_metrics(straight)[1:], after, rel=1e-3,
                          keys=COMPARED + ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_max"))
    if offload:
        kept, dropped = read_metrics(single_process_run)[1], read_metrics(run_dir)[1]
        # Offloaded: nothing of actor, critic or reference stays in memory while the rollout generates.
        assert dropped["memory/resident_gb/gen"] == 0 < dropped["memory/resident_gb/old_log_prob"]
        assert kept["memory/resident_gb/gen"] > 0 and kept["perf/offload_bytes"] == 0
        # Each step moves every engine's state out and back in.
        assert dropped["perf/offload_bytes"] == dropped["perf/onload_bytes"] > 0


# what differs between two runs of the same numbers: clocks, memory and the sync's own bytes
NOT_NUMERICS = ("timing_s/", "perf/", "memory/", "training/hybrid_sync_bytes", "training/hybrid_sync_peak_bytes",
                "training/hybrid_sync_changed_fraction")


def test_delta_sync_logs_what_full_sync_logs():
    """rollout.weight_sync.mode=delta loads, bit for bit, the weights a full sync loads
    (tests/hybrid/test_reshard.py checks the streams at every step), so the demo's tp2 run logs every
    metric of the same run in full mode exactly: rewards, losses, KL, gradient norms, the sync check's
    log-prob gaps (issue 42). The delta run is the layout test's tp2 run (shared)."""
    tp2 = {**layout_overrides(2, 1, 1), **CORRECTION}
    delta = read_metrics(reference_run(2, **tp2, **{"rollout.weight_sync.mode": "delta"}))
    full = read_metrics(reference_run(2, **tp2))
    assert len(delta) == len(full) == 2
    for d, f in zip(delta, full):
        numerics = sorted(k for k in f if not k.startswith(NOT_NUMERICS))
        assert sorted(k for k in d if not k.startswith(NOT_NUMERICS)) == numerics
        assert len(numerics) > 30 and "actor/pg_loss" in numerics and "training/sync_logprob_diff_max" in numerics
        differ = {k: (f[k], d[k]) for k in numerics if f[k] != d[k]}
        assert not differ, f"step {f['step']}: delta and full sync logged different numbers: {differ}"
    assert delta[1]["training/hybrid_sync_bytes"] < full[1]["training/hybrid_sync_bytes"] + 24 * 64


@pytest.fixture
def single_process_run():
    """The one-process run the layouts are compared with: once per session (tests/shared_runs.py)."""
    return reference_run(0, **{"trainer.total_steps": 2}, **CORRECTION)


# The smallest split validation accepts: 2 prompts x 2 samples = 4 responses per step, cut into
# mini-batches of one response per DP rank (dp2: 2 mini-batches of 2; tp2: 4 mini-batches of 1),
# against one process cutting the same global mini-batches.
SMALLEST = {"data.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "trainer.total_steps": 2}


@pytest.mark.parametrize("nproc,tp,mini_batches", [(2, 1, 2), (2, 2, 4)], ids=["dp2", "tp2"])
def test_same_run_under_every_layout_at_the_smallest_split(tmp_path_factory, nproc, tp, mini_batches):
    root = tmp_path_factory.mktemp(f"smallest_tp{tp}")
    split = {**SMALLEST, "actor.ppo_mini_batches": mini_batches, "critic.ppo_mini_batches": mini_batches}
    launch_ok(nproc, shared_overrides(root / "parallel", **split, **{"parallel.tp": tp}))
    single, parallel = read_metrics(reference_run(0, **split)), read_metrics(root / "parallel")
    assert len(single) == len(parallel) == 2
    _assert_close(single, parallel, rel=1e-3)


def test_reward_collapse_guard_rolls_back_and_halves_lr(tmp_path):
    # A hair-trigger guard (any score below 95% of its 1-step EMA) so that it fires in a short run.
    run_dir = tmp_path / "run"
    launch_ok(2, small_run_overrides(tmp_path, run_dir, **{
        "trainer.total_steps": 6, "trainer.save_every_steps": 1, "actor.optim.schedule": "constant",
        "guards.reward_collapse_fraction": 0.95, "guards.reward_ema_steps": 1}))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    fired = [r["step"] for r in lines if r.get("event") == "guard/reward_collapse"]
    assert any(step < 6 for step in fired), f"the guard did not fire before the last step: {fired}"
    lrs = {r["step"]: r["actor/lr"] for r in lines if "event" not in r}
    first = min(fired)
    assert lrs[first + 1] == pytest.approx(lrs[first] / 2)  # halved, and the roll-back did not undo it
    assert next(r for r in lines if r.get("step") == first and "event" not in r)["guard/reward_collapse"] == 1.0


SEPARATE = {"rollout.placement": "separate", "rollout.num_ranks": 1}


def test_separate_placement_at_k0_logs_what_colocated_logs(tmp_path_factory, single_process_run):
    """1 training + 1 rollout rank (issue 24): the same samples (seeds do not depend on placement),
    so the same metrics as one colocated process; the rollout rank received exactly its shard."""
    run_dir = tmp_path_factory.mktemp("separate") / "k0"
    # (the one-process run trains with TIS under top_p: the same here, the ratio from the rollout rank's log-probs)
    # the weights go by delta (rollout.weight_sync): the same metrics, and the full bound beside the bytes
    launch_ok(2, shared_overrides(run_dir, **{"trainer.total_steps": 2, "rollout.weight_sync.mode": "delta"},
                                  **SEPARATE, **CORRECTION))
    single, separate = read_metrics(single_process_run), read_metrics(run_dir)
    assert len(single) == len(separate) == 2
    _assert_close(single, separate, rel=1e-3)
    for row in separate:
        assert row["async/staleness_max"] == 0 and row["async/dropped_stale"] == 0
        shard, full = row["async/rollout_shard_bytes"], row["async/rollout_sync_full_bytes"]
        assert shard > 0 and 0 <= full - shard < 8 * 64, (shard, full)  # alignment padding only
        assert 0 < row["async/rollout_sync_bytes"] < full + 24 * 64 and 0 < row["async/rollout_sync_changed_fraction"] <= 1.0
    assert separate[0]["async/rollout_sync_changed_fraction"] == 1.0  # the first stream is full
