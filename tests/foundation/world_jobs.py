"""Jobs for tests/foundation/test_worlds.py, run on every rank of a persistent test world."""
from __future__ import annotations

import os
import sys
import time


def rank_and_pid() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), os.getpid()


def all_reduce_rank() -> int:
    """The sum of the ranks over the world's default group: the group works."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t)
    return int(t.item())


def print_and_fail_on(rank: int) -> None:
    import torch.distributed as dist

    print(f"stdout of rank {dist.get_rank()}", flush=True)
    os.write(2, f"fd-2 of rank {dist.get_rank()}\n".encode())  # below Python, as C++ code writes
    if dist.get_rank() == rank:
        raise RuntimeError(f"rank {rank} fails on purpose")


def hang_on(rank: int) -> None:
    import torch.distributed as dist

    if dist.get_rank() == rank:
        time.sleep(3600)


def end_the_default_group() -> None:
    """What a worker script does at its end; the next job makes the group again."""
    import torch.distributed as dist

    dist.destroy_process_group()


def exit_with(code: int) -> None:
    sys.exit(code)


_LEFT_ALIVE: list = []  # what a leaking job keeps referenced for the rest of the rank's life


def leave_threads(count: int) -> None:
    """A job that leaves `count` idle threads behind, as a job whose models stay referenced leaves their
    process groups' gloo threads."""
    import threading

    stop = threading.Event()
    _LEFT_ALIVE.append(stop)
    for _ in range(count):
        thread = threading.Thread(target=stop.wait, daemon=True)
        thread.start()
        _LEFT_ALIVE.append(thread)
