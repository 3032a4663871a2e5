"""Rendezvous preflight: the mistakes torchrun turns into long hangs, found in bounded time, said in one line.

    python -m megarl.runtime.rendezvous --endpoint HOST:PORT --nnodes N --node-rank I [--timeout-s 120]

Run on every node just before `torchrun --rdzv-backend c10d --rdzv-endpoint HOST:PORT` (the Slurm
template does). torchrun itself, given a port that another program holds, connects to that program
and waits out its whole rendezvous timeout; given an address nobody answers at, or fewer nodes than
--nnodes, it also waits the timeout and then prints a long traceback. Here node 0 binds the port (in
use: said at once), every node counts itself in on a small store there, and each check has its own
deadline. Exit 0 when all N nodes arrived; otherwise one line on stderr and exit 2. Node 0 releases
the port before torchrun takes it; the other nodes' torchrun retries its connection until it listens.
"""
from __future__ import annotations

import argparse
import datetime
import errno
import os
import socket
import sys
import time

EXIT_BAD_RENDEZVOUS = 2


class RendezvousError(Exception):
    pass


def _resolve(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except socket.gaierror as err:
        raise RendezvousError(f"rendezvous address {host!r} does not resolve ({err.strerror}): set the rendezvous "
                              f"endpoint (MASTER_ADDR) to the first node's name or address") from None


def _check_port_free(host: str, ip: str, port: int) -> None:
    with socket.socket() as s:
        # SO_REUSEADDR as torchrun's store sets it: a previous run's connections in TIME_WAIT do not count,
        # only a program listening there does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise RendezvousError(f"rendezvous port {port} on {host} is in use by another program: choose a free "
                                      f"port (MASTER_PORT)") from None
            if err.errno == errno.EADDRNOTAVAIL:
                raise RendezvousError(f"rendezvous address {host} ({ip}) is not an address of node rank 0: the endpoint "
                                      f"must name the first node (MASTER_ADDR)") from None
            raise


def check(host: str, port: int, nnodes: int, node_rank: int, timeout_s: float, key: str = "megarl-preflight") -> None:
    """Raises RendezvousError with the one-line reason; returns when all nnodes nodes checked in."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # c10d logs every retried connection: one line is the point
    from torch.distributed import TCPStore  # deferred: torch reads TORCH_CPP_LOG_LEVEL (set above) when it loads

    ip = _resolve(host)
    deadline = time.monotonic() + timeout_s
    if node_rank == 0:
        _check_port_free(host, ip, port)
        store = TCPStore(ip, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
    else:
        store = None
        while store is None:
            try:
                store = TCPStore(ip, port, is_master=False, timeout=datetime.timedelta(seconds=min(5.0, timeout_s)))
            except (RuntimeError, TimeoutError):  # node 0 not listening yet, or unreachable: retry until the deadline
                if time.monotonic() > deadline:
                    raise RendezvousError(f"node rank {node_rank} cannot reach the rendezvous at {host}:{port} within "
                                          f"{timeout_s:g} s: check the address (MASTER_ADDR), that node 0 runs, and the "
                                          f"network between them") from None
                time.sleep(1)
    arrived = store.add(f"{key}/arrived", 1)
    if arrived > nnodes:
        raise RendezvousError(f"more nodes than --nnodes {nnodes} reached the rendezvous at {host}:{port}: the node "
                              f"count (sbatch --nodes / torchrun --nnodes) does not match the nodes started")
    while (arrived := store.add(f"{key}/arrived", 0)) < nnodes:
        if time.monotonic() > deadline:
            raise RendezvousError(f"only {arrived} of {nnodes} nodes reached the rendezvous at {host}:{port} within "
                                  f"{timeout_s:g} s: the node count (--nnodes) does not match the nodes started, or "
                                  f"some cannot reach node 0")
        time.sleep(0.5)
    store.add(f"{key}/done", 1)
    if node_rank == 0:  # keep the store up until every node has read the count, then free the port
        while store.add(f"{key}/done", 0) < nnodes and time.monotonic() < deadline:
            time.sleep(0.2)
        del store


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="check a c10d rendezvous endpoint before torchrun")
    p.add_argument("--endpoint", required=True, help="HOST:PORT, as given to torchrun --rdzv-endpoint")
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--timeout-s", type=float, default=120.0)
    args = p.parse_args(argv)
    host, _, port = args.endpoint.rpartition(":")
    if not host or not port.isdigit():
        print(f"rendezvous error: endpoint {args.endpoint!r} is not HOST:PORT", file=sys.stderr)
        return EXIT_BAD_RENDEZVOUS
    try:
        check(host, int(port), args.nnodes, args.node_rank, args.timeout_s)
    except RendezvousError as err:
        print(f"rendezvous error: {err}", file=sys.stderr)
        return EXIT_BAD_RENDEZVOUS
    return 0


if __name__ == "__main__":
    sys.exit(main())
