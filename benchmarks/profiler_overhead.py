"""Does `trainer.profile_steps` cost the steps it does not record? (issue 27)

    python benchmarks/profiler_overhead.py [--steps 8] [--profile-step 2] [--out benchmarks/results/profiler_overhead_cpu.json]

Two single-process runs of configs/tiny_cpu.yaml through benchmarks/_ppo_probe.py (CPU seconds per
phase, and a calibration workload timed around every step): one with trainer.profile_steps=[P],
one without. The figure is the ratio of the medians, over the steps after P, of each step's CPU
seconds divided by its calibration: 1.0 means the unrecorded steps cost what they cost without
the profiler configured. The recorded step's own cost is given too (its CPU seconds over the
median unrecorded step of the same run). A ratio measured side by side, never a timing assert.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_result  # benchmarks/_common.py

REPO = Path(__file__).resolve().parents[1]


def run(steps: int, *overrides: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "benchmarks/_ppo_probe.py", "--config", "configs/tiny_cpu.yaml", f"trainer.run_dir={run_dir}",
               f"model.path={Path(tmp) / 'model'}", f"trainer.total_steps={steps}", "trainer.save_every_steps=0",
               "tracking.progress_bar=false", "tracking.loggers=[jsonl]", *overrides]
        subprocess.run(cmd, cwd=REPO, check=True, env=dict(os.environ, PYTHONWARNINGS="ignore"), stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "event" not in r]
    for r in rows:
        r["cpu"] = sum(v for k, v in r.items() if k.startswith("bench/cpu_s/"))
        r["calibrated"] = r["cpu"] / r["bench/calibration_cpu_s"]
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--profile-step", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/profiler_overhead_cpu.json")
    args = p.parse_args(argv)
    after = lambda rows: [r for r in rows if r["step"] > args.profile_step]  # noqa: E731
    plain = run(args.steps)
    profiled = run(args.steps, f"trainer.profile_steps=[{args.profile_step}]")
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    recorded = next(r for r in profiled if r["step"] == args.profile_step)
    result = {
        "unrecorded_steps_calibrated_cpu_ratio_profiled_over_plain": round(med(after(profiled), "calibrated") / med(after(plain), "calibrated"), 3),
        "recorded_step_cpu_over_median_unrecorded_step": round(recorded["cpu"] / med(after(profiled), "cpu"), 3),
        "median_step_cpu_seconds": {"plain": round(med(after(plain), "cpu"), 4), "profiled_run": round(med(after(profiled), "cpu"), 4)},
        "steps_compared": [r["step"] for r in after(plain)],
        "command": f"python benchmarks/profiler_overhead.py --steps {args.steps} --profile-step {args.profile_step} --out {args.out}",
        "machine": {"processor": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "load_average_1_5_15": list(os.getloadavg()),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "note": "one process each; CPU seconds of the PPO phases (benchmarks/_ppo_probe.py) divided by a calibration "
                "workload timed around the same step; medians over the steps after the recorded one",
    }
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
