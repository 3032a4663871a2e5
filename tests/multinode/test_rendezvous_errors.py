"""Rendezvous mistakes end within a bounded time with one line saying which (megarl/runtime/rendezvous.py,
run by launch/slurm/ppo.sbatch before torchrun): a port in use, an address nobody answers at or that
does not resolve, a node count that does not match."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

import netns
from conftest import REPO, free_port

TIMEOUT_S = 6


def preflight(endpoint: str, nnodes: int, node_rank: int, prefix: list[str] = ()) -> subprocess.Popen:
    cmd = [*prefix, sys.executable, "-m", "megarl.runtime.rendezvous", "--endpoint", endpoint, "--nnodes", str(nnodes),
           "--node-rank", str(node_rank), "--timeout-s", str(TIMEOUT_S)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=TIMEOUT_S + 60)  # bounded: the check's own deadline, plus start-up
    return proc.returncode, err.strip()


def test_port_in_use_is_said_at_once():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        rc, err = finish(preflight(f"127.0.0.1:{port}", 1, 0))
    assert rc == 2 and err == (f"rendezvous error: rendezvous port {port} on 127.0.0.1 is in use by another program: "
                               f"choose a free port (MASTER_PORT)")


def test_unresolvable_address():
    rc, err = finish(preflight("no-such-node.invalid:29500", 2, 1))
    assert rc == 2 and err.startswith("rendezvous error: rendezvous address 'no-such-node.invalid' does not resolve")
    assert "\n" not in err


def test_fewer_nodes_than_nnodes():
    start = time.monotonic()
    rc, err = finish(preflight(f"127.0.0.1:{free_port()}", 2, 0))
    assert rc == 2 and "\n" not in err
    assert err.startswith("rendezvous error: only 1 of 2 nodes reached the rendezvous at 127.0.0.1:")
    assert time.monotonic() - start >= TIMEOUT_S  # it waited its deadline, not torchrun's


@pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))
def test_two_nodes_pass_and_an_address_nobody_answers_at_fails():
    with netns.two_nodes() as nodes:
        endpoint = f"{nodes[0].addr}:{free_port()}"
        procs = [preflight(endpoint, 2, rank, node.prefix()) for rank, node in enumerate(nodes)]
        assert [finish(p) for p in procs] == [(0, ""), (0, "")]
        # node 1 alone, node 0 never started: nothing answers at node 0's address
        rc, err = finish(preflight(endpoint, 2, 1, nodes[1].prefix()))
    assert rc == 2 and err == (f"rendezvous error: node rank 1 cannot reach the rendezvous at {endpoint} within "
                               f"{TIMEOUT_S} s: check the address (MASTER_ADDR), that node 0 runs, and the network "
                               f"between them")
