"""Running an environment's calls (tool calls, `Environment.step`s) concurrently, so that one
that raises or hangs costs one observation and at most one timeout, never the batch or the run.

    executor = ToolExecutor(max_concurrency=8, timeout_s=30.0)
    outcomes = executor.map([lambda: env.step(turn) for env, turn in ...])   # in call order
    outcome.ok / .value / .observation ("[tool error] ..." / "[tool timeout] ...")
    executor.metrics()  ->  {"agents/tool_calls": ..., "agents/tool_errors": ..., "agents/tool_timeouts": ...}

Calls run on threads: an environment is stateful Python that must stay in this process. A thread
cannot be killed, so a call that times out is abandoned: its slot is freed at once (the bound on
concurrency counts live calls) and whatever it returns later is dropped; `agents/tool_abandoned`
counts those still running. Code that must really be stopped (model-written code) runs in
`megarl.agents.sandbox.run_python`, whose own timeout kills its process tree.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class CallOutcome:
    """One call's result: value when ok; otherwise observation names the failure (what the
    environment hands the policy) and failure is "error" or "timeout"."""

    value: Any = None
    observation: str | None = None
    failure: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.failure is None


class ToolExecutor:
    """Bounded-concurrency calls, each with its own timeout; failures counted (see module doc)."""

    def __init__(self, max_concurrency: int = 8, timeout_s: float = 30.0):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.max_concurrency, self.timeout_s = max_concurrency, timeout_s
        self.calls = self.errors = self.timeouts = 0
        self._abandoned: list[threading.Thread] = []

    def map(self, calls: Sequence[Callable[[], Any]]) -> list[CallOutcome]:
        """Run every call (at most max_concurrency at once, each for at most timeout_s from its
        start); outcomes in the order of `calls`."""
        outcomes: list[CallOutcome | None] = [None] * len(calls)
        done: queue.Queue = queue.Queue()
        running: dict[int, tuple[threading.Thread, float]] = {}  # index -> (thread, start time)
        waiting = list(range(len(calls)))[::-1]
        while waiting or running:
            while waiting and len(running) < self.max_concurrency:
                i = waiting.pop()
                thread = threading.Thread(target=_run_one, args=(i, calls[i], done), daemon=True, name=f"megarl-tool-{i}")
                running[i] = (thread, time.monotonic())
                thread.start()
            next_deadline = min(start for _, start in running.values()) + self.timeout_s
            try:
                i, value, error, seconds = done.get(timeout=max(next_deadline - time.monotonic(), 0.0))
            except queue.Empty:
                i = None
            if i is not None and i in running:  # a late result of an abandoned call is not in running
                del running[i]
                outcomes[i] = (CallOutcome(value=value, seconds=seconds) if error is None else
                               CallOutcome(observation=f"[tool error] {type(error).__name__}: {error}", failure="error",
                                           seconds=seconds))
            now = time.monotonic()
            for j, (thread, start) in list(running.items()):
                if now - start >= self.timeout_s:
                    del running[j]
                    self._abandoned.append(thread)
                    outcomes[j] = CallOutcome(observation=f"[tool timeout] no result after {self.timeout_s:g} s",
                                              failure="timeout", seconds=now - start)
        self.calls += len(calls)
        self.errors += sum(o.failure == "error" for o in outcomes)
        self.timeouts += sum(o.failure == "timeout" for o in outcomes)
        return outcomes  # type: ignore[return-value]

    def metrics(self) -> dict[str, float]:
        """Counts since construction (a trainer logs their per-step differences or totals)."""
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return {"agents/tool_calls": float(self.calls), "agents/tool_errors": float(self.errors),
                "agents/tool_timeouts": float(self.timeouts), "agents/tool_abandoned": float(len(self._abandoned))}


def _run_one(i: int, call: Callable[[], Any], done: queue.Queue) -> None:
    start = time.monotonic()
    try:
        value, error = call(), None
    except Exception as e:  # noqa: BLE001 - any failure of a tool becomes an observation
        value, error = None, e
    done.put((i, value, error, time.monotonic() - start))
