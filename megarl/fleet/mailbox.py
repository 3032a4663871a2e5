"""A queue between threads that wakes a ZeroMQ poller (rollout.placement=fleet).

A ZeroMQ socket belongs to one thread, so the other threads hand their messages to the socket's
thread through a queue. A plain queue is only looked at when the poller's timeout runs out: every
message waited up to a poll interval, four times a step (weights out, ready back, requests out,
results back), about a tenth of a second of every fleet step on the quiet 2-core machine. A
`Mailbox` also writes a byte to a pipe whose read end the poller watches beside its sockets, so
the socket's thread wakes as soon as something is put.
"""
from __future__ import annotations

import os
import queue
from typing import Any, Iterator


class Mailbox:
    """`put` from any thread; `fileno()` registered with the owning thread's zmq.Poller; `take_all()`
    there, after each poll."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def put(self, item: Any) -> None:
        self._items.put(item)
        try:
            os.write(self._write, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the poller will wake

    def fileno(self) -> int:
        return self._read

    def empty(self) -> bool:
        return self._items.empty()

    def take_all(self) -> Iterator[Any]:
        """Every item put so far, oldest first. The wake-ups are cleared before the items are taken,
        so an item put meanwhile leaves a wake-up behind for the next poll."""
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                yield self._items.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)
