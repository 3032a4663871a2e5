"""rollout.placement=fleet end to end on 127.0.0.1 (issue 41): a one-process trainer under
`torchrun --max-restarts 1`, two rollout servers, one killed (SIGKILL) in the middle of step 2's
requests, a new one started while step 3 waits for rollout.fleet.min_servers, a server with the wrong
token refused meanwhile, and then the trainer itself killed in the middle of step 4's requests: torchrun
restarts it, it resumes from its step-3 checkpoint, and the servers, which keep their engines, join it
again.

The run exits 0; fleet/servers reads 2, 1, 2, 2; every prompt of every step is trained once; and since a
sample is a function of the weights, the prompt and its seed, the resubmitted requests come back as
they would have: the run's metrics and trained samples, those after the restart included, equal the
colocated run's at the same seed (a run that never stopped, which a run resumed from the same
checkpoint equals: tests/trainer/test_ppo_runs.py)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import REPO, free_port, wait_for_output

sys.path.insert(0, str(REPO / "tests" / "trainer"))
sys.path.insert(0, str(REPO / "tests" / "tracking"))
from ppo_helpers import read_metrics, reference_run, shared_overrides  # noqa: E402
from prometheus_helpers import FLEET_ROW, dashboard_exprs, dashboard_metric_names  # noqa: E402

from megarl.runtime.preemption import PREEMPTED_EXIT_CODE  # noqa: E402
from megarl.tracking.prometheus import prometheus_name  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

STEPS = 4
COMMON = {"trainer.total_steps": STEPS, "tracking.sample_ids": "true"}
FLEET_ONLY = {"trainer.save_every_steps": 3}  # the checkpoint the restarted trainer resumes from


def _worker_pid(launcher: subprocess.Popen) -> int:
    """The pid of launch/ppo.py under a torchrun launcher (its descendant)."""
    for child in psutil.Process(launcher.pid).children(recursive=True):
        if "launch/ppo.py" in child.cmdline():
            return child.pid
    pytest.fail(f"no launch/ppo.py process under the launcher {launcher.pid}")


def test_fleet_survives_lost_servers_and_its_trainer_and_equals_the_colocated_run(tmp_path):
    run_dir, port = tmp_path / "fleet", free_port()
    overrides = shared_overrides(run_dir, **COMMON, **FLEET_ONLY, **{
        "rollout.placement": "fleet", "rollout.fleet.port": port, "rollout.fleet.heartbeat_s": 5,
        "rollout.fleet.min_servers": 2})
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs: list[subprocess.Popen] = []

    def start(args: list[str], log: Path, extra_env: dict | None = None) -> subprocess.Popen:
        out = open(log, "w")
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env={**env, **(extra_env or {})}, stdout=out,
                                stderr=subprocess.STDOUT)
        out.close()
        procs.append(proc)
        return proc

    def server(name: str, token_file: Path, extra_env: dict | None = None) -> subprocess.Popen:
        return start(["-m", "megarl.rollout.serve", "--trainer", f"127.0.0.1:{port}", "--token-file", str(token_file),
                      "--server-id", name], tmp_path / f"{name}.log", extra_env)

    try:
        trainer_log = tmp_path / "trainer.log"
        trainer = start(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "--max-restarts", "1",
                         "launch/ppo.py", "--config", "configs/tiny_cpu.yaml", *overrides], trainer_log)
        wait_for_output(trainer_log, "megarl fleet: endpoint open", trainer)
        token_file = run_dir / "fleet.token"
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        wrong = tmp_path / "wrong.token"
        wrong.write_text("not-the-token\n")
        # a: slow on purpose (each request waits 2 s), so the kill lands mid-request
        a = server("a", token_file, {"MEGARL_FLEET_TEST_DELAY_S": "2"})
        server("b", token_file)
        intruder = server("intruder", wrong)
        wait_for_output(tmp_path / "a.log", "step 2:", a)
        a.send_signal(signal.SIGKILL)
        wait_for_output(trainer_log, "step 3: waiting for rollout servers: 1 of 2", trainer)
        c = server("c", token_file, {"MEGARL_FLEET_TEST_DELAY_S": "2"})  # slow too: the trainer's kill lands mid-request
        wait_for_output(tmp_path / "c.log", "step 4:", c)
        os.kill(_worker_pid(trainer), signal.SIGKILL)  # after step 3's checkpoint, in the middle of step 4
        assert trainer.wait(timeout=300) == 0, trainer_log.read_text()[-4000:]
        assert intruder.wait(timeout=60) == 2
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = trainer_log.read_text()
    assert "megarl fleet: refused server 'intruder': wrong token" in log
    assert "megarl fleet: lost server a (silent for" in log

    assert log.count("megarl fleet: endpoint open") == 2  # the trainer, and the trainer torchrun restarted
    for name in ("b", "c"):  # each server noticed the dead trainer and joined the new one with its engine
        server_log = (tmp_path / f"{name}.log").read_text()
        assert "the trainer closed the connection: joining again" in server_log, server_log[-3000:]
        assert "kept the engine built for this model" in server_log, server_log[-3000:]
        assert server_log.count("weight link built") == 2, server_log[-3000:]  # a link from each trainer

    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["fleet/servers"] for m in metrics] == [2, 1, 2, 2]
    before, after = metrics[2], metrics[3]  # the counters are the endpoint's: the restarted trainer's start at 0
    assert (before["fleet/lost_total"], before["fleet/joined_total"], before["fleet/refused_total"]) == (1, 3, 1)
    assert before["fleet/resubmitted_total"] == 4  # a's half of step 2's 8 prompts
    assert (after["fleet/lost_total"], after["fleet/joined_total"], after["fleet/resubmitted_total"]) == (0, 2, 0)
    assert {"fleet/tokens_per_s/b", "fleet/tokens_per_s/c"} <= set(after)
    # the Grafana dashboard's fleet row charts what this run serves to Prometheus
    served = {prometheus_name(k) for k in after}
    assert dashboard_metric_names(FLEET_ROW) and not dashboard_metric_names(FLEET_ROW) - served
    per_server = re.search(r'__name__=~"([^"]+)"', " ".join(dashboard_exprs(FLEET_ROW))).group(1)
    assert {n for n in served if re.fullmatch(per_server, n)} == {prometheus_name("fleet/tokens_per_s/b"),
                                                                  prometheus_name("fleet/tokens_per_s/c")}

    # every prompt of every step trained once, each sample named with its server and weights version
    steps = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    for line, servers in zip(steps, ({"a", "b"}, {"b"}, {"b", "c"}, {"b", "c"}), strict=True):
        keys = [(r[1], r[2]) for r in line["samples"]]
        assert sorted(keys) == [(p, j) for p in range(8) for j in range(4)]
        assert {r[4] for r in line["samples"]} == servers  # a's step-2 requests were finished by b
        assert all(set(r[3]) == {line["step"]} for r in line["samples"])  # weights version = step here

    # the colocated run at the same seed: the same samples and the same metrics
    reference = reference_run(0, **COMMON)
    ref_steps = [json.loads(line) for line in (reference / "samples.jsonl").read_text().splitlines()]
    assert [[r[:3] for r in s["samples"]] for s in steps] == [[r[:3] for r in s["samples"]] for s in ref_steps]
    for fleet_row, ref_row in zip(metrics, read_metrics(reference), strict=True):
        compared = [k for k in ref_row if k in fleet_row and isinstance(ref_row[k], (int, float))
                    and not k.startswith(("timing_s/", "perf/", "memory/", "throughput/"))]
        assert len(compared) > 30
        for key in compared:
            assert fleet_row[key] == pytest.approx(ref_row[key], abs=1e-6), key


def test_a_signal_while_waiting_for_servers_stops_the_run_at_once(tmp_path):
    """No server comes; SIGTERM (Slurm's preemption) to the waiting trainer ends the wait instead of
    the step boundary, which never comes: exit 75 with one line, no checkpoint and no metrics of the
    untrained step (the same command resumes from the last checkpoint; here none: from the start)."""
    run_dir = tmp_path / "run"
    overrides = shared_overrides(run_dir, **{"trainer.total_steps": 2, "rollout.placement": "fleet",
                                             "rollout.fleet.port": free_port(), "rollout.fleet.heartbeat_s": 1})
    log = tmp_path / "trainer.log"
    with open(log, "w") as out:
        trainer = subprocess.Popen([sys.executable, "launch/ppo.py", "--config", "configs/tiny_cpu.yaml", *overrides],
                                   cwd=REPO, env=dict(os.environ, PYTHONWARNINGS="ignore"), stdout=out,
                                   stderr=subprocess.STDOUT)
    try:
        wait_for_output(log, "step 1: waiting for rollout servers: 0 of 1", trainer)
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=120) == PREEMPTED_EXIT_CODE, log.read_text()[-4000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    text = log.read_text()
    assert ("megarl: SIGTERM while step 1 waited for rollout servers: 0 of 1 held weights version 1: stopped "
            "without training step 1 and without a new checkpoint; exit code 75") in text, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    assert not list((run_dir / "checkpoints").glob("step_*")) and read_metrics(run_dir) == []

