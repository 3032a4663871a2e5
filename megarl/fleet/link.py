"""The fleet's weight links (rollout.placement=fleet): one two-rank torch.distributed group per joined
server, outside the training world, built when the server joins and rebuilt when it joins again.

ZeroMQ carries the messages; the weights' bytes go over the link, a gloo group of the trainer's rank
0 (rank 0 of the link) and the server (rank 1). A torch.distributed world cannot grow or shrink, so
each server gets a group of its own: a server that dies breaks its own link only (the trainer's send
fails, the server is dropped as lost), and a server that joins, or joins again, gets a new one. The
groups meet through one TCPStore that rank 0 of the training job serves on rollout.fleet.host (a
port the OS picks, told to each server in its welcome); each link has its own key prefix.

Gloo runs on CPU tensors (here, and as the transport a GPU trainer would fall back to); an NCCL link
for servers on GPUs is not built yet (docs/rollout.md, "Fleet").
"""
from __future__ import annotations

import datetime
import itertools
import math
import socket

import torch
import torch.distributed as dist

from megarl.fleet.wire import DTYPE_NAMES, DTYPES, aligned
from megarl.platform.process_groups import gloo_group

BACKEND = "gloo"


def _group(store: dist.Store, prefix: str, rank: int, host: str, timeout_s: float) -> dist.ProcessGroup:
    """The two-rank gloo group of link `prefix`, its transport bound to `host` (blocks until both
    ranks are there, at most timeout_s)."""
    return gloo_group(dist.PrefixStore(prefix, store), rank, 2, host, timeout_s)


class LinkHost:
    """The trainer's side: the store the links meet through, and each link's rank 0."""

    def __init__(self, host: str, timeout_s: float):
        self.host, self.timeout_s = host, timeout_s
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.port = self.store.port
        self._prefixes = (f"link{k}/" for k in itertools.count(1))

    def offer(self) -> dict:
        """The welcome's `transfer` field for a server that joins: where its link meets."""
        return {"backend": BACKEND, "port": self.port, "prefix": next(self._prefixes), "timeout_s": self.timeout_s}

    def accept(self, offer: dict) -> dist.ProcessGroup:
        """Rank 0 of the offered link (blocks until the server builds its side, at most timeout_s)."""
        return _group(self.store, offer["prefix"], 0, self.host, self.timeout_s)


def join(trainer_host: str, offer: dict) -> dist.ProcessGroup:
    """The server's side of an offered link, rank 1, reaching the trainer at `trainer_host` (the
    address it joined by) and bound to this host's address towards it."""
    timeout = datetime.timedelta(seconds=offer["timeout_s"])
    store = dist.TCPStore(trainer_host, offer["port"], is_master=False, timeout=timeout)
    return _group(store, offer["prefix"], 1, _address_towards(trainer_host), offer["timeout_s"])


def _address_towards(host: str) -> str:
    """This host's address on the route to `host` (no packet is sent: a UDP socket only routes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def flatten(named) -> tuple[list[dict], torch.Tensor]:
    """(the weights message's tensor entries, every tensor's bytes in one uint8 tensor, in order, each
    at a multiple of wire.ALIGN). Each tensor is copied as `named` yields it: the stream may reuse its
    buffers, so a view kept until the final concatenation could read the next tensor's values."""
    entries, parts = [], []
    for name, tensor in named:
        tensor = tensor.detach().to("cpu").contiguous()
        entries.append({"name": name, "dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape)})
        data = tensor.reshape(-1).view(torch.uint8).clone()
        parts += [data, torch.zeros(aligned(data.numel()) - data.numel(), dtype=torch.uint8)]
    return entries, torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def nbytes(entries: list[dict]) -> int:
    """The bytes of a weights buffer with these entries."""
    return sum(aligned(math.prod(e["shape"]) * DTYPES[e["dtype"]].itemsize) for e in entries)


def unflatten(entries: list[dict], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a received weights buffer (views into `flat`)."""
    out, offset = [], 0
    for entry in entries:
        dtype = DTYPES[entry["dtype"]]
        size = math.prod(entry["shape"]) * dtype.itemsize
        out.append((entry["name"], flat[offset:offset + size].view(dtype).reshape(entry["shape"])))
        offset += aligned(size)
    return out


def send(link: dist.ProcessGroup, flat: torch.Tensor):
    """The weights to the server (rank 1); the returned work's `wait()` raises if the link broke (at
    once for a link already known broken, whose send fails as it is issued)."""
    try:
        return link.send([flat], 1, 0)
    except Exception as err:
        return _Broken(err)


class _Broken:
    """The work of a send that failed when it was issued."""

    def __init__(self, err: Exception):
        self.err = err

    def wait(self, timeout=None):
        raise self.err


def receive(link: dist.ProcessGroup, size: int, timeout_s: float) -> torch.Tensor:
    """The trainer's next weights buffer of `size` bytes."""
    flat = torch.empty(size, dtype=torch.uint8)
    link.recv([flat], 0, 0).wait(datetime.timedelta(seconds=timeout_s))
    return flat
