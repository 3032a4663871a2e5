"""rollout.placement=fleet across two network-namespace nodes (issue 41): the trainer on node 0 (two
training processes, dp 2: rank 0 speaks to the fleet for both) binds its endpoint to node 0's address only; server a runs on node 0, server b on node 1. Node 1's link is
cut (no FIN reaches anyone) while b holds half of step 2: only the heartbeat notices, b's requests go
to a, and step 3 waits for rollout.fleet.min_servers=2 until the link comes back and b, hearing
nothing from the trainer, joins again. The run exits 0, fleet/servers reads 2, 1, 2, and its metrics
and samples equal the colocated two-process run's at the same seed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import netns
from conftest import REPO, free_port, wait_for_output

sys.path.insert(0, str(REPO / "tests" / "trainer"))
from ppo_helpers import read_metrics, reference_run, shared_overrides  # noqa: E402

REASON = netns.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

COMMON = {"trainer.total_steps": 3, "tracking.sample_ids": "true"}


def test_fleet_across_nodes_survives_a_cut_link(tmp_path):
    port = free_port()
    run_dir = tmp_path / "fleet"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs: list[subprocess.Popen] = []

    def start(node, args: list[str], log: Path, extra_env: dict | None = None) -> subprocess.Popen:
        with open(log, "w") as out:
            proc = subprocess.Popen([*node.prefix(), sys.executable, *args], cwd=REPO, env={**env, **(extra_env or {})},
                                    stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    with netns.two_nodes() as (node0, node1):
        overrides = shared_overrides(run_dir, **COMMON, **{
            "rollout.placement": "fleet", "rollout.fleet.host": node0.addr, "rollout.fleet.port": port,
            "rollout.fleet.heartbeat_s": 3, "rollout.fleet.min_servers": 2})

        def server(node, name: str, extra_env: dict | None = None) -> subprocess.Popen:
            return start(node, ["-m", "megarl.rollout.serve", "--trainer", f"{node0.addr}:{port}", "--token-file",
                                str(run_dir / "fleet.token"), "--server-id", name], tmp_path / f"{name}.log", extra_env)

        def link(state: str) -> None:
            subprocess.run([*node1.prefix(), "ip", "link", "set", node1.ifname, state], check=True, timeout=30)

        try:
            trainer_log = tmp_path / "trainer.log"
            trainer = start(node0, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "launch/ppo.py",
                                     "--config", "configs/tiny_cpu.yaml", *overrides], trainer_log)
            wait_for_output(trainer_log, "megarl fleet: endpoint open", trainer)
            # bound to node 0's address only: its loopback has no endpoint
            probe = subprocess.run([*node0.prefix(), sys.executable, "-c",
                                    f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5)"],
                                   capture_output=True, text=True, timeout=60)
            assert probe.returncode != 0 and "Connection refused" in probe.stderr
            server(node0, "a")
            b = server(node1, "b", {"MEGARL_FLEET_TEST_DELAY_S": "2"})  # slow: the cut lands mid-request
            wait_for_output(tmp_path / "b.log", "step 2:", b)
            link("down")
            wait_for_output(trainer_log, "step 3: waiting for rollout servers: 1 of 2", trainer)
            link("up")
            assert trainer.wait(timeout=300) == 0, trainer_log.read_text()[-4000:]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    log = trainer_log.read_text()
    assert "megarl fleet: lost server b (silent for" in log
    b_log = (tmp_path / "b.log").read_text()
    assert "joining again" in b_log
    # the weights go over a link of b's own, across the nodes; joining again, b got a new one
    assert b_log.count("weight link built") == 2 and log.count("megarl fleet: weight link to server b built") == 2
    metrics = read_metrics(run_dir)
    assert [m["fleet/servers"] for m in metrics] == [2, 1, 2]
    assert (metrics[-1]["fleet/lost_total"], metrics[-1]["fleet/joined_total"]) == (1, 3)
    steps = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [{r[4] for r in s["samples"]} for s in steps] == [{"a", "b"}, {"a"}, {"a", "b"}]

    reference = reference_run(2, **COMMON)
    ref_steps = [json.loads(line) for line in (reference / "samples.jsonl").read_text().splitlines()]
    assert [[r[:3] for r in s["samples"]] for s in steps] == [[r[:3] for r in s["samples"]] for s in ref_steps]
    for fleet_row, ref_row in zip(metrics, read_metrics(reference), strict=True):
        for key in ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/ppo_kl", "actor/grad_norm"):
            assert fleet_row[key] == pytest.approx(ref_row[key], abs=1e-6), key
