"""launch/slurm/ppo.sbatch under a real Slurm (slurmctld + one slurmd per network-namespace node):
`sbatch --nodes 2`, two torchruns rendezvous on the first node's NodeAddr, each picks its own
interface; USR1 (what --signal=B:USR1@180 sends before the time limit) in the middle of a 6-step run
checkpoints, the script requeues, and the requeued job's metrics equal a straight run's. One rank per
node with tp2 across the nodes: the tensor-parallel collectives cross the veth link, and two ranks keep
the test at about half the time of four on a 2-core CI machine."""
from __future__ import annotations

import signal
import sys
import time

import psutil

import pytest

import netns
import slurm_cluster
from conftest import REPO, free_port

sys.path.insert(0, str(REPO / "tests" / "trainer"))
from ppo_helpers import launch_ok, read_metrics, small_run_overrides  # noqa: E402

REASON = netns.unavailable() or slurm_cluster.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

COMPARED = ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/ppo_kl", "actor/grad_norm",
            "critic/grad_norm", "critic/returns/mean", "critic/values/mean", "actor/entropy")
# Six steps, the signal after the first: the stop must land before the last step, which on a quiet
# machine is a few seconds away (with four steps and the signal after the second it sometimes was not).
CHEAP = {"trainer.total_steps": 6, "data.prompts_per_step": 4, "rollout.samples_per_prompt": 2,
         "actor.ppo_epochs": 1, "critic.ppo_epochs": 1, "parallel.tp": 2}


def test_sbatch_two_nodes_usr1_requeue_resumes_to_the_straight_run(tmp_path):
    straight, slurm_run = tmp_path / "straight", tmp_path / "slurm"
    launch_ok(2, small_run_overrides(tmp_path, straight, **CHEAP))  # one node, the same 2-rank layout

    with netns.two_nodes() as nodes, slurm_cluster.slurm_cluster(nodes, tmp_path / "slurm-cluster") as cluster:
        log = tmp_path / "job.out"
        submit = ["sbatch", "--parsable", "--nodes", "2", "--gpus-per-node=0", f"--output={log}", f"--chdir={REPO}",
                  "--export=ALL,NPROC_PER_NODE=1,SHUTDOWN_TIMEOUT_S=120,"
                  f"MASTER_PORT={free_port()},PYTHON={sys.executable},PYTHONPATH={REPO}",
                  "launch/slurm/ppo.sbatch", "configs/tiny_cpu.yaml", *small_run_overrides(tmp_path, slurm_run, **CHEAP)]
        job = cluster.run(*submit).stdout.strip().split(";")[0]
        deadline = time.monotonic() + 600
        while not ((slurm_run / "metrics.jsonl").is_file() and len(read_metrics(slurm_run)) >= 1):
            assert time.monotonic() < deadline, f"no step after 600 s:\n{log.read_text() if log.exists() else ''}"
            assert cluster.job_state(job).get("JobState") in ("PENDING", "CONFIGURING", "RUNNING"), log.read_text()
            time.sleep(0.5)
        # USR1 to the batch shell alone, as `#SBATCH --signal=B:USR1@180` delivers it near the time limit
        script = next(p for p in psutil.process_iter(["cmdline"])
                      if f"job{int(job):05d}/slurm_script" in " ".join(p.info["cmdline"] or []))
        script.send_signal(signal.SIGUSR1)
        info = cluster.wait_for(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), timeout=900)
        out = log.read_text()
        assert info["JobState"] == "COMPLETED", f"{info}\n{out[-6000:]}\n{cluster.logs()}"
        assert info["Restarts"] == "1", info
    assert "requeueing job" in out and "SIGUSR1: stopped after step" in out, out[-6000:]
    assert "restart 1: 2 nodes x 1" in out and "resumed from" in out, out[-6000:]
    assert "interface mrl0-" in out and "interface mrl1-" in out, out[-6000:]  # each node found its own link
    a, b = read_metrics(straight), read_metrics(slurm_run)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b):
        for k in COMPARED:
            assert rb[k] == pytest.approx(ra[k], rel=1e-6, abs=1e-9), f"step {ra['step']} {k}: {ra[k]} vs {rb[k]}"
