"""megarl.agents.tools.ToolExecutor: concurrent calls with bounded concurrency and a per-call
timeout; a call that raises or hangs becomes an observation naming the failure, is counted, and
costs at most one timeout."""
from __future__ import annotations

import threading
import time

import pytest

from megarl.agents.sandbox import SandboxUnavailable, check_available, run_python
from megarl.agents.tools import ToolExecutor


def test_a_hanging_and_a_raising_call_cost_one_timeout_not_the_batch():
    never = threading.Event()

    def hang():
        never.wait()

    def boom():
        raise KeyError("no such city")

    calls = [lambda i=i: i * i for i in range(6)]
    calls[2], calls[4] = hang, boom
    executor = ToolExecutor(max_concurrency=3, timeout_s=0.5)
    start = time.monotonic()
    outcomes = executor.map(calls)
    elapsed = time.monotonic() - start
    never.set()
    # one timeout (0.5 s) plus scheduling; the hung call's slot was freed at its deadline
    assert elapsed < 1.5, elapsed
    assert [o.value for o in outcomes if o.ok] == [0, 1, 9, 25]
    assert outcomes[2].failure == "timeout" and outcomes[2].observation == "[tool timeout] no result after 0.5 s"
    assert outcomes[4].failure == "error" and outcomes[4].observation == "[tool error] KeyError: 'no such city'"
    metrics = executor.metrics()
    assert (metrics["agents/tool_calls"], metrics["agents/tool_errors"], metrics["agents/tool_timeouts"]) == (6.0, 1.0, 1.0)


def test_concurrency_is_bounded_and_used():
    lock, live, peak = threading.Lock(), [0], [0]

    def call():
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.05)
        with lock:
            live[0] -= 1
        return "ok"

    outcomes = ToolExecutor(max_concurrency=3, timeout_s=10).map([call] * 12)
    assert [o.value for o in outcomes] == ["ok"] * 12
    assert peak[0] == 3


def test_several_hung_calls_each_cost_one_timeout_in_parallel():
    never = threading.Event()
    executor = ToolExecutor(max_concurrency=4, timeout_s=0.4)
    start = time.monotonic()
    outcomes = executor.map([never.wait] * 4 + [lambda: "fine"])
    elapsed = time.monotonic() - start
    never.set()
    assert [o.failure for o in outcomes] == ["timeout"] * 4 + [None]
    assert elapsed < 1.2, elapsed  # two waves of 0.4 s at most, not four


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_concurrency must be >= 1"):
        ToolExecutor(max_concurrency=0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        ToolExecutor(timeout_s=0)


def _sandbox_missing() -> str | None:
    try:
        check_available()
    except SandboxUnavailable as e:
        return str(e)
    return None


@pytest.mark.skipif(_sandbox_missing() is not None, reason=f"sandbox unavailable here: {_sandbox_missing()}")
def test_sandboxed_code_that_sleeps_forever_costs_one_sandbox_timeout():
    """The code tool as an environment would use it: four programs at once, one sleeping forever."""
    programs = ["print(sum(range(10)))", "import time\ntime.sleep(10**6)", "print('a' * 3)", "raise SystemExit(4)"]
    executor = ToolExecutor(max_concurrency=4, timeout_s=60)
    start = time.monotonic()
    # the quick programs get room for sandbox start-up on a loaded machine; the sleeper 3 s
    timeouts = [30.0, 3.0, 30.0, 30.0]
    outcomes = executor.map([lambda code=code, t=t: run_python(code, timeout_s=t) for code, t in zip(programs, timeouts)])
    elapsed = time.monotonic() - start
    results = [o.value for o in outcomes]
    assert [r.stdout for r in results] == ["45\n", "", "aaa\n", ""]
    assert [r.timed_out for r in results] == [False, True, False, False]
    assert results[3].exit_code == 4
    assert elapsed < 15, elapsed  # the sleeper's one 3 s timeout plus start-up: the batch returned
