"""The step's phase clock: `PhaseClock(timing)("timing_s/<phase>")` is a context manager that adds
the phase's wall time to `timing`, names the phase for stall reports (megarl.runtime.heartbeat) and
the profiler (a ppo_step/<phase> range, megarl.runtime.profiling), and calls `after(name)` at the
end of a phase that did not raise (the trainer samples resident memory there).

benchmarks/_ppo_probe.py (the speed gate's probe) hooks `PhaseTimer.__enter__/__exit__` to time
the same phases: renaming them means updating the probe."""
from __future__ import annotations

import time
from typing import Callable

from megarl.runtime import heartbeat, profiling


class PhaseClock:
    """Times named phases into `timing`; `after(name)` runs at the end of each (memory sampling)."""

    def __init__(self, timing: dict[str, float], after: Callable[[str], None] | None = None):
        self.timing, self.after = timing, after

    def __call__(self, name: str) -> PhaseTimer:
        return PhaseTimer(self, name)


class PhaseTimer:
    """One phase of a `PhaseClock`: a context manager."""

    def __init__(self, clock: PhaseClock, name: str):
        self.clock, self.name = clock, name

    def __enter__(self):
        heartbeat.enter(self.name)  # the phase a stall report names (megarl/runtime/heartbeat.py)
        self.range = profiling.phase(self.name.replace("timing_s/", "ppo_step/"))
        self.range.__enter__()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.range.__exit__(*exc)
        timing = self.clock.timing
        timing[self.name] = timing.get(self.name, 0.0) + time.perf_counter() - self.start
        if self.clock.after is not None and exc[0] is None:
            self.clock.after(self.name)
