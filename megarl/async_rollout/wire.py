"""The objects the training ranks and the rollout ranks send each other under rollout.placement=separate
(pickled, length first, on host tensors over gloo): below server.py, client.py and engine_side.py, which
all speak it."""
from __future__ import annotations

import pickle

import torch
import torch.distributed as dist


def send_object(obj, dst: int, group) -> None:
    """A picklable object to global rank `dst`: its length, then its bytes (host tensors: gloo)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst=dst, group=group)
    dist.send(payload, dst=dst, group=group)


def recv_object(src: int | None, group):
    """The next object from `src`, or from any rank when src is None (torch's recv_object_list
    takes no wildcard source)."""
    size = torch.empty(1, dtype=torch.int64)
    sender = dist.recv(size, src=src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src=sender, group=group)
    return pickle.loads(payload.numpy().tobytes())
