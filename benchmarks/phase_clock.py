"""The clock the regression gate times a phase with: wall seconds, the gated figure, and the process's CPU
seconds beside it as a diagnostic.

Wall time because that is what a user waits for: a stall (an added barrier, a blocking host sync, a slow
collective) costs wall time and no CPU time, and on a GPU nearly all of a step is the host waiting for
kernels. On CUDA the phase's edges are device edges: the device is synchronised when the phase starts (work
queued by the phase before must not be billed to it) and the wall time is the elapsed time between two CUDA
events recorded at the edges, read after a synchronisation at the end (so a kernel the phase queued and did not
wait for is billed to it, not to the next phase). torch is imported only for a CUDA clock, so the statistics and
the CPU path stay importable without it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class PhaseTime:
    wall_s: float  # the gated figure (CUDA-event time on a GPU)
    cpu_s: float   # this process's CPU seconds over the phase: a diagnostic (a wait costs none)


class PhaseClock:
    """start() -> token; stop(token) -> PhaseTime. `device` 'cuda' times with CUDA events, anything else
    with time.perf_counter."""

    def __init__(self, device: str = "cpu"):
        self.cuda = device == "cuda"
        if self.cuda:
            import torch

            self._torch = torch

    def start(self):
        if self.cuda:
            self._torch.cuda.synchronize()
            event = self._torch.cuda.Event(enable_timing=True)
            event.record()
            return event, time.process_time()
        return time.perf_counter(), time.process_time()

    def stop(self, token) -> PhaseTime:
        begun, cpu0 = token
        if self.cuda:
            end = self._torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return PhaseTime(begun.elapsed_time(end) / 1000.0, time.process_time() - cpu0)
        return PhaseTime(time.perf_counter() - begun, time.process_time() - cpu0)


def clock_for_this_machine() -> PhaseClock:
    """CUDA events where a GPU is in use, the host's wall clock otherwise."""
    try:
        import torch
    except ImportError:
        return PhaseClock("cpu")
    return PhaseClock("cuda" if torch.cuda.is_available() else "cpu")
