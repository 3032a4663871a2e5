"""Log lines written by a thread of their own (rollout.placement=fleet).

The fleet's socket threads log while holding the endpoint's lock or between heartbeats. A write can
block for seconds: a log file under the kernel's dirty-page throttling while pip or a checkpoint
writes gigabytes, a full pipe, a slow network file system. Written in place, such a write held up
the trainer's socket thread (and the trainer's thread waiting for its lock) past heartbeat_s, and
the trainer declared servers lost whose heartbeats were waiting unread in ZeroMQ's queue (seen in a
CI run: servers joined and were lost over and over for two minutes). Handed to a `BackgroundLog`, a
line costs a queue put; the writing thread alone waits for the file.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable


class BackgroundLog:
    """`log(line)` from any thread, written in order by a thread of its own; `close()` writes what is
    left and stops it."""

    def __init__(self, write: Callable[[str], None]):
        self._write = write
        self._lines: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="megarl-fleet-log", daemon=True)
        self._thread.start()

    def __call__(self, line: str) -> None:
        self._lines.put(line)

    def close(self, timeout_s: float = 10.0) -> None:
        self._lines.put(None)
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while (line := self._lines.get()) is not None:
            try:
                self._write(line)
            except Exception:  # a log that cannot be written must not end the fleet's logging
                pass
