"""launch/ppo.py with two benchmark hooks, for benchmarks/suite.py (run it like launch/ppo.py).

- CPU seconds per phase: the machine is shared, so wall time mostly measures the neighbours;
  the process's CPU time (`time.process_time`, one process, one thread per op) measures the work.
  Logged as `bench/cpu_s/<phase>`, with `bench/calibration_cpu_s`: the CPU time of a fixed
  workload like the actor update run before and after every PPO step, so that suite.py's
  figures are CPU-speed independent too.
- Injection: `MEGARL_BENCH_SLOWDOWN=<phase>:<fraction>` (e.g. `update_actor:0.2`) busy-works, at
  the end of that phase, `fraction` x the CPU time the phase took: a real 20% slowdown of one
  phase, to show that `make bench-check` catches it and names the phase. Read here only (never by
  megarl's training code). The injected CPU seconds are logged as `bench/injected_cpu_s/<phase>`, so
  the figure without them can be shown too (tests/benchmarks/test_slowdown_check.py).
"""
from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def calibration_cpu_seconds(repeats: int = 3) -> float:
    """Median CPU seconds of a fixed training workload shaped like the demo's actor update (a
    hidden-64, two-layer MLP stack on 1,024 tokens: forward, backward, Adam). Work of the same
    kind suffers the same cache and core-sharing slowdowns from the neighbours, so the ratio to
    it holds still where a generic calibration did not (a matmul/Python mix moved 0.73x between
    two runs while the phases moved 0.87x)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[m for _ in range(2) for m in (torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64))])
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.randn(1024, 64)
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(4):
            loss = net(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        times.append(time.process_time() - t0)
    return sorted(times)[len(times) // 2]


def _spin(cpu_seconds: float) -> None:
    end = time.process_time() + cpu_seconds
    while time.process_time() < end:
        pass


def install() -> None:
    from megarl import trainer as trainer_module

    timer = getattr(trainer_module, "_Timer", None)
    if timer is None:
        raise SystemExit("benchmarks/_ppo_probe.py: megarl.trainer has no _Timer any more; update the phase hooks")
    cpu: dict[str, float] = {}
    injected: dict[str, float] = {}
    slow_phase, _, fraction = (os.environ.get("MEGARL_BENCH_SLOWDOWN") or "").partition(":")
    enter, exit_ = timer.__enter__, timer.__exit__

    def timed_enter(self):
        self._cpu_start = time.process_time()
        return enter(self)

    def timed_exit(self, *exc):
        phase = self.name.removeprefix("timing_s/")
        if phase == slow_phase:
            t0 = time.process_time()
            _spin(float(fraction) * (t0 - self._cpu_start))
            injected[phase] = injected.get(phase, 0.0) + time.process_time() - t0
        cpu[phase] = cpu.get(phase, 0.0) + time.process_time() - self._cpu_start
        return exit_(self, *exc)

    timer.__enter__, timer.__exit__ = timed_enter, timed_exit
    step = trainer_module.Trainer.ppo_step

    def ppo_step(self):
        before = calibration_cpu_seconds()
        cpu.clear()
        injected.clear()
        result = step(self)  # StepResult(metrics, events)
        result.metrics.update({f"bench/cpu_s/{k}": v for k, v in cpu.items()})
        result.metrics.update({f"bench/injected_cpu_s/{k}": v for k, v in injected.items()})
        result.metrics["bench/calibration_cpu_s"] = (before + calibration_cpu_seconds()) / 2
        return result

    trainer_module.Trainer.ppo_step = ppo_step


if __name__ == "__main__":
    install()
    sys.argv = [str(REPO / "launch" / "ppo.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
