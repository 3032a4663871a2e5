"""`make bench-check` (benchmarks/suite.py check, benchmarks/gate.py) on real regressions (issue 38).

The gate measures this checkout against a base revision, both running the PPO demo in the same run,
interleaved step by step. Here the base is HEAD and the candidate is this working tree with a regression
injected by MEGARL_BENCH_INJECT (read by benchmarks/_ppo_probe.py, given to the candidate only; megarl's
training code never reads it): the gate must fail naming the slowed phase. The same tree without an
injection must pass against HEAD. A small geometry (8 prompts x 8 samples, 2 epochs x 2 mini-batches,
~0.1 s a step) keeps each gate run to about half a minute, most of it the two processes' start.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gate  # noqa: E402

# 30 rounds, 30 more while a phase is inconclusive (at most 60 here, 90 in make bench-check): the budget of CI.
SMALL = ["--set", "data.prompts_per_step=8", "--set", "rollout.samples_per_prompt=8",
         "--set", "actor.ppo_mini_batches=2", "--set", "actor.ppo_epochs=2", "--max-rounds", "60"]


def _check(tmp_path, *args, inject: str | None = None, timeout: int = 600):
    env = {k: v for k, v in os.environ.items() if k != "MEGARL_BENCH_INJECT"}
    env["PYTHONPATH"] = str(REPO)
    if inject:
        env["MEGARL_BENCH_INJECT"] = inject
    return subprocess.run([sys.executable, "benchmarks/suite.py", "check", "--out", str(tmp_path / "check.json"), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("injection, phase", [
    ("train_step_stall:0.25", "update_actor"),  # MegatronEngine.train_step waits 25% of its own time: a stall
    ("generate_busy:0.25", "gen"),              # the rollout engine's generate busy-loops 25% of its time
    ("sync_barrier:0.25", "sync"),              # the weight sync ends with an extra barrier that waits
])
def test_an_injected_regression_fails_the_gate_naming_its_phase(tmp_path, injection, phase):
    proc = _check(tmp_path, "--base", "HEAD", *SMALL, inject=injection)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failures = [line for line in proc.stdout.splitlines() if line.startswith("REGRESSION: ")]
    named = [line for line in failures if line.startswith(f"REGRESSION: phase '{phase}' takes ")]
    assert named and "interval" in named[0] and " in " in named[0].split("rounds)")[-1], proc.stdout
    result = json.loads((tmp_path / "check.json").read_text())
    assert result["injected_into_candidate"] == injection
    v = next(v for v in result["verdicts"] if v["phase"] == phase)
    assert v["regressed"] and v["interval"][0] > 1.0 and v["ratio"] > 1.1
    if injection.startswith("train_step_stall"):
        # The stall costs wall time, not CPU time: the CPU-seconds gate this replaces read it as ~1.0x.
        assert v["candidate_cpu_median_s"] / v["base_cpu_median_s"] < v["ratio"] - 0.1


@pytest.mark.slow
def test_the_same_code_against_its_own_commit_passes(tmp_path):
    proc = _check(tmp_path, "--base", "HEAD", *SMALL)
    assert proc.returncode == 0 and "bench-check: passed" in proc.stdout, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "check.json").read_text())
    assert {v["phase"] for v in result["verdicts"] if v["gated"]} >= {"sync", "gen", "old_log_prob", "update_actor", "step"}
    rounds = len(result["samples"]["base"]["wall_s"])  # 30, or more where a phase was inconclusive (a loaded machine)
    assert rounds == len(result["samples"]["candidate"]["wall_s"]) == result["rounds"] and rounds in (30, 60)
    # the order alternates, base first in even rounds (the 2 warm-up rounds included): what gate_stats compares by
    base_first = result["samples"]["base"]["ran_first"]
    assert base_first == [j % 2 == 0 for j in range(rounds)]
    assert result["samples"]["candidate"]["ran_first"] == [not f for f in base_first]


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    proc = _check(tmp_path, "--base", "no-such-revision")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: bench-check: --base 'no-such-revision' is not a commit of this repository; pass a branch, tag or hash (e.g. --base main)"]
    proc = _check(tmp_path, "--base", "HEAD", inject="train_step_stal:0.25")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "'train_step_stal:0.25' is not <name>:<fraction > 0> with name one of train_step_stall, generate_busy, sync_barrier" in proc.stderr
    proc = _check(tmp_path, "--base-dir", str(tmp_path))  # a machine without the history: the base comes as a checkout
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: bench-check: --base-dir {tmp_path}: not a megarl checkout (no launch/ppo.py and megarl/ in it)"]


def _git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_the_default_base_is_the_merge_base_with_main_else_the_last_baseline_tag(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "commit", "-qm", "one")
    fork = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-qb", "feature")
    (repo / "a.py").write_text("x = 2\n")
    _git(repo, "commit", "-qam", "two")
    head = _git(repo, "rev-parse", "HEAD")
    assert gate.resolve_base(None, repo) == fork
    assert gate.resolve_base("HEAD", repo) == head
    assert gate.commit_range(fork, repo) == f"{fork[:10]}..{head[:10]}"
    (repo / "a.py").write_text("x = 3\n")
    assert gate.commit_range(fork, repo) == f"{fork[:10]}..{head[:10]} (+ uncommitted changes)"
    assert (gate.export_checkout(fork, tmp_path / "base", repo) / "a.py").read_text() == "x = 1\n"  # the base's files

    _git(repo, "branch", "-qm", "main", "old")  # no main any more: the newest bench-baseline tag
    with pytest.raises(gate.GateError, match=r"no base revision: .* pass --base REV"):
        gate.resolve_base(None, repo)
    _git(repo, "tag", "bench-baseline-2026-12-05", fork)
    assert gate.resolve_base(None, repo) == fork
