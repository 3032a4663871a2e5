"""A two-"machine" cluster on one host: network namespaces joined by a veth pair.

Each node is a namespace with its own interface and address (10.<a>.<b>.1 and .2, /30) and its own
loopback, so a torchrun in node 1 reaches node 0 only through that link, as across a network: the
rendezvous, gloo's connections and the interface variables (GLOO_SOCKET_IFNAME) all get exercised.
Traffic never leaves the two namespaces. Needs root (CAP_NET_ADMIN) and iproute2; `unavailable()`
says why not, for a visible skip.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Node:
    netns: str    # namespace name
    ifname: str   # its end of the veth pair (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)
    addr: str     # its address on the link

    def prefix(self) -> list[str]:
        """Prepend to a command to run it on this node."""
        return ["ip", "netns", "exec", self.netns]


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", netns, "ip"] if netns else ["ip"]) + list(args)
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why this host cannot build the cluster, or None."""
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`) for network namespaces"
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add)"
    probe = f"megarl-probe-{os.getpid()}"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"ip netns add failed: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@contextlib.contextmanager
def two_nodes(tag: str | None = None):
    """Yields (node0, node1); everything is deleted on exit, also when the body raises."""
    tag = tag or str(os.getpid())
    octet = os.getpid() % 250 + 1  # distinct subnets for concurrent test sessions
    nodes = [Node(f"megarl-n{i}-{tag}", f"mrl{i}-{tag}"[:15], f"10.231.{octet}.{i + 1}") for i in range(2)]
    created = []
    try:
        for node in nodes:
            _ip("netns", "add", node.netns)
            created.append(node.netns)
            _ip("link", "set", "lo", "up", netns=node.netns)
        _ip("link", "add", nodes[0].ifname, "type", "veth", "peer", "name", nodes[1].ifname)
        for node in nodes:
            _ip("link", "set", node.ifname, "netns", node.netns)
            _ip("addr", "add", f"{node.addr}/30", "dev", node.ifname, netns=node.netns)
            _ip("link", "set", node.ifname, "up", netns=node.netns)
        yield tuple(nodes)
    finally:
        for name in created:  # deleting a namespace deletes its end of the veth pair, and so the pair
            for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
