"""launch/ppo.py with two benchmark hooks, for benchmarks/suite.py (run it like launch/ppo.py).

- Calibration: before and after every PPO step the process times a fixed CPU workload
  (`calibration_seconds`) and logs the mean as `bench/calibration_s`; suite.py divides each
  phase's seconds by it, so a machine that is slower or busier as a whole does not read as a
  regression, while a phase that got slower does.
- Injection: `MEGARL_BENCH_SLOWDOWN=<phase>:<fraction>` (e.g. `update_actor:0.2`) sleeps,
  at the end of that phase, `fraction` x the phase's own elapsed time: a real slowdown of one
  phase by that fraction, to show that `make bench-check` catches it.
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


def calibration_seconds(repeats: int = 3) -> float:
    """Median seconds of a fixed mix like the phases' (small matmuls, elementwise ops, Python)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(128, 128, generator=g), torch.randn(128, 128, generator=g)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = a
        for _ in range(60):
            x = torch.tanh(x @ b) * 0.5 + a
        sum(i * i for i in range(20000))
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def install() -> None:
    from megarl import trainer as trainer_module

    Trainer = trainer_module.Trainer
    step = Trainer.ppo_step

    def ppo_step(self):
        before = calibration_seconds()
        metrics = step(self)
        metrics["bench/calibration_s"] = (before + calibration_seconds()) / 2
        return metrics

    Trainer.ppo_step = ppo_step
    spec = os.environ.get("MEGARL_BENCH_SLOWDOWN")
    if spec:
        phase, _, fraction = spec.partition(":")
        timer = getattr(trainer_module, "_Timer", None)
        if timer is None:
            raise SystemExit("benchmarks/_ppo_probe.py: megarl.trainer has no _Timer any more; update the injection hook")
        exit_ = timer.__exit__

        def slowed_exit(self, *exc):
            if self.name == f"timing_s/{phase}":
                time.sleep(float(fraction) * (time.perf_counter() - self.start))
            return exit_(self, *exc)

        timer.__exit__ = slowed_exit


if __name__ == "__main__":
    install()
    sys.argv = [str(REPO / "launch" / "ppo.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
