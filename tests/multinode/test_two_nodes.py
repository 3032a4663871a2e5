"""Two nodes for real: network namespaces joined by a link, one torchrun per node with c10d rendezvous
on node 0's address, 2 processes per node. tp2 inside a node x dp2 across nodes, and tp2 x pp2 with the
pipeline across nodes, log the same metrics as the same run on one node (1e-3 relative)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import netns
from conftest import REPO, free_port

sys.path.insert(0, str(REPO / "tests" / "trainer"))
from ppo_helpers import launch_ok, read_metrics, small_run_overrides  # noqa: E402

REASON = netns.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

COMPARED = ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/ppo_kl", "actor/grad_norm",
            "critic/grad_norm", "critic/returns/mean", "actor/entropy")
STEPS = 2


def run_on_two_nodes(nodes, args: list[str], timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """`torchrun --nnodes 2 --node-rank i --rdzv-backend c10d --rdzv-endpoint <node0>:<port> args` on each node."""
    endpoint = f"{nodes[0].addr}:{free_port()}"  # free on the host; node 0's namespace has its own ports
    procs = []
    for rank, node in enumerate(nodes):
        cmd = [*node.prefix(), sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "megarl-test",
               # node 0 hosts the rendezvous store: torchrun cannot tell by itself here, as the namespaces share
               # the host's name (on a cluster, it matches the endpoint against its own name and addresses)
               "--rdzv-conf", f"is_host={int(rank == 0)}",
               # and the workers' store address: by default node 0's host name, which resolves outside the namespaces
               "--local-addr", node.addr, *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GLOO_SOCKET_IFNAME=node.ifname)
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.fixture(scope="module")
def one_node_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("multinode")
    run_dir = root / "one_node"
    launch_ok(4, small_run_overrides(root, run_dir, **{"trainer.total_steps": STEPS, "parallel.tp": 2}))
    return run_dir


@pytest.mark.parametrize("pp", [1, 2], ids=["tp2-in-node_dp2-across", "tp2-in-node_pp2-across"])
def test_two_node_run_equals_one_node_run(one_node_run, pp):
    root = one_node_run.parent
    run_dir = root / f"two_nodes_pp{pp}"
    overrides = small_run_overrides(root, run_dir, **{"trainer.total_steps": STEPS, "parallel.tp": 2, "parallel.pp": pp})
    with netns.two_nodes() as nodes:
        results = run_on_two_nodes(nodes, ["launch/ppo.py", "--config", "configs/tiny_cpu.yaml", *overrides])
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node {node} exited {result.returncode}:\n{result.stdout[-6000:]}"
    # tp2 runs with sequence parallelism, the default at tp > 1 ("sp" in the layout line)
    assert f"megarl: world=4 tp=2 sp pp={pp} cp=1 dp={2 // pp}" in results[0].stdout, results[0].stdout[-3000:]
    a, b = read_metrics(one_node_run), read_metrics(run_dir)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        for k in COMPARED:
            assert rb[k] == pytest.approx(ra[k], rel=1e-3, abs=1e-9), f"step {ra['step']} {k}: {ra[k]} vs {rb[k]}"
