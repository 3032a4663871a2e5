"""rollout.placement=fleet at async.max_staleness=1 (issue 41, item 4): the trainer submits each step's
requests a step ahead, so the servers generate step t + 1 while it trains step t.

A sample is a function of the weights, the prompt and its seed, and a server takes new weights only
between requests, in the order they came: step t's requests, sent with the weights of step t - 1,
are generated with those. So the run trains what separate placement at async.max_staleness=1 trains
(its rollout rank generates step t with the same weights), and logs its metrics, the `async/`
staleness ones included; and every sample is one update old from step 2 on, never more.

ReMax over a fleet (at K = 0) generates its greedy baseline over the fleet too, from the step's
weights, and logs the colocated ReMax run's metrics."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, free_port, wait_for_output

sys.path.insert(0, str(REPO / "tests" / "trainer"))
from ppo_helpers import read_metrics, reference_run, shared_overrides  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

STEPS = 4
COMMON = {"trainer.total_steps": STEPS, "tracking.sample_ids": "true", "async.max_staleness": 1}
# metrics only one of the two placements has, or that measure its own transport
OWN = ("timing_s/", "perf/", "memory/", "throughput/", "fleet/", "async/rollout_", "async/trainer_wait_s",
       "training/hybrid_sync")


def test_fleet_at_k1_trains_what_separate_placement_at_k1_trains(tmp_path):
    run_dir, port = tmp_path / "fleet", free_port()
    overrides = shared_overrides(run_dir, **COMMON, **{
        "rollout.placement": "fleet", "rollout.fleet.port": port, "rollout.fleet.min_servers": 2})
    # a slow: weights reach it while it generates
    _fleet_run(tmp_path, run_dir, port, overrides, {"a": {"MEGARL_FLEET_TEST_DELAY_S": "0.5"}, "b": {}})

    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    # step 1 trains the samples of the first weights; every later step those of the step before
    assert [m["async/staleness_max"] for m in metrics] == [0, 1, 1, 1]
    assert [m["async/dropped_stale"] for m in metrics] == [0, 0, 0, 0]
    steps = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    for line in steps:  # every prompt once; the weights version that generated it (the fleet's: = its step)
        assert sorted((r[1], r[2]) for r in line["samples"]) == [(p, j) for p in range(8) for j in range(4)]
        assert {tuple(r[3]) and r[3][0] for r in line["samples"]} == {max(line["step"] - 1, 1)}
        assert {r[4] for r in line["samples"]} == {"a", "b"}

    # separate placement at K = 1 (one training rank, one rollout rank): the same samples, the same metrics
    reference = reference_run(2, **COMMON, **{"rollout.placement": "separate", "rollout.num_ranks": 1})
    ref_steps = [json.loads(line) for line in (reference / "samples.jsonl").read_text().splitlines()]
    assert [[r[:3] for r in s["samples"]] for s in steps] == [[r[:3] for r in s["samples"]] for s in ref_steps]
    for fleet_row, ref_row in zip(metrics, read_metrics(reference), strict=True):
        compared = [k for k in ref_row if k in fleet_row and isinstance(ref_row[k], (int, float)) and not k.startswith(OWN)]
        assert len(compared) > 30 and "async/staleness_mean" in compared
        for key in compared:
            assert fleet_row[key] == pytest.approx(ref_row[key], abs=1e-6), key


def test_remax_over_a_fleet_takes_its_greedy_baseline_from_the_servers(tmp_path):
    """algorithm.adv_estimator=remax at async.max_staleness=0: each step's greedy baseline is a second
    generation over the fleet, from the same weights as its samples; the run logs the colocated
    ReMax run's metrics (the advantages are rewards less that baseline)."""
    remax = {"trainer.total_steps": 2, "algorithm.adv_estimator": "remax"}
    run_dir, port = tmp_path / "fleet", free_port()
    overrides = shared_overrides(run_dir, **remax, **{"rollout.placement": "fleet", "rollout.fleet.port": port})
    _fleet_run(tmp_path, run_dir, port, overrides, {"g": {}})
    server_log = (tmp_path / "g.log").read_text()
    assert server_log.count("step 1:") == 2, server_log[-3000:]  # the samples' requests and the baseline's
    reference = reference_run(0, **remax)
    for fleet_row, ref_row in zip(read_metrics(run_dir), read_metrics(reference), strict=True):
        compared = [k for k in ref_row if k in fleet_row and isinstance(ref_row[k], (int, float)) and not k.startswith(OWN)]
        assert len(compared) > 20 and "critic/advantages/mean" in compared  # no critic under ReMax
        for key in compared:
            assert fleet_row[key] == pytest.approx(ref_row[key], abs=1e-6), key


def test_partial_rollouts_over_a_fleet_take_new_weights_between_tokens(tmp_path):
    """async.partial_rollout at async.max_staleness=1: an hf server slowed between tokens (2 s: step 2's
    request lasts about 6 s after step 1's samples are in, long enough for step 1's update on a loaded
    machine) is still generating step 2 when the trainer publishes step 2's weights; it loads them between two tokens,
    so step 2's samples span two versions (each token names its own), their age counts from the
    oldest token, and nothing is dropped or trained twice."""
    run_dir, port = tmp_path / "fleet", free_port()
    overrides = shared_overrides(run_dir, **{
        "trainer.total_steps": 2, "tracking.sample_ids": "true", "async.max_staleness": 1, "async.partial_rollout": "true",
        "rollout.ignore_eos": "true", "rollout.placement": "fleet", "rollout.fleet.port": port})
    _fleet_run(tmp_path, run_dir, port, overrides, {"p": {"MEGARL_FLEET_TEST_TOKEN_DELAY_S": "2"}})
    metrics = read_metrics(run_dir)
    steps = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    for line in steps:
        assert sorted((r[1], r[2]) for r in line["samples"]) == [(p, j) for p in range(8) for j in range(4)]
        assert all(r[3] == sorted(r[3]) and len(r[3]) == 4 for r in line["samples"])  # versions never go back
    spanning = [r for r in steps[1]["samples"] if len(set(r[3])) > 1]
    assert spanning and {tuple(sorted(set(r[3]))) for r in spanning} == {(1, 2)}, steps[1]["samples"][:4]
    assert metrics[1]["async/partial_fraction"] == len(spanning) / 32
    assert [m["async/staleness_max"] for m in metrics] == [0, 1]  # from the oldest token
    assert [m["async/dropped_stale"] for m in metrics] == [0, 0]


def _fleet_run(tmp_path, run_dir, port: int, overrides: list[str], servers: dict[str, dict]) -> None:
    """The trainer (one process) and its servers ({name: extra environment}), started once its
    endpoint is open; the trainer must exit 0."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs: list[subprocess.Popen] = []

    def start(args: list[str], name: str, extra_env: dict) -> subprocess.Popen:
        with open(tmp_path / f"{name}.log", "w") as out:
            procs.append(subprocess.Popen([sys.executable, *args], cwd=REPO, env={**env, **extra_env}, stdout=out,
                                          stderr=subprocess.STDOUT))
        return procs[-1]

    try:
        trainer = start(["launch/ppo.py", "--config", "configs/tiny_cpu.yaml", *overrides], "trainer", {})
        wait_for_output(tmp_path / "trainer.log", "megarl fleet: endpoint open", trainer)
        for name, extra_env in servers.items():
            start(["-m", "megarl.rollout.serve", "--trainer", f"127.0.0.1:{port}", "--token-file",
                   str(run_dir / "fleet.token"), "--server-id", name], name, extra_env)
        assert trainer.wait(timeout=300) == 0, (tmp_path / "trainer.log").read_text()[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
