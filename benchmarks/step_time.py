"""PPO step time of the CPU demo, per phase, with tokens/s.

    python benchmarks/step_time.py --nproc 2 --steps 20 --out benchmarks/results/step_time_cpu.json [key=value ...]

Runs launch/ppo.py on configs/tiny_cpu.yaml (overrides allowed) in a temporary run directory and
summarises metrics.jsonl: median seconds per phase over the steps after the first (warm-up), the
median step time and perf/throughput (tokens per second per rank). Absolute numbers, recorded with
the machine and date, to compare runs on the same machine.
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        overrides = [f"trainer.run_dir={run_dir}", f"trainer.total_steps={args.steps}", "trainer.save_every_steps=0",
                     "tracking.progress_bar=false", "tracking.mlflow=false", *args.overrides]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "launch/ppo.py", "--config", args.config, *overrides]
        start = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, check=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "event" not in r][1:]  # drop the warm-up step
    phases = sorted(k for k in rows[0] if k.startswith("timing_s/"))
    result = {
        "command": " ".join(["python", "benchmarks/step_time.py", f"--nproc {args.nproc}", f"--steps {args.steps}", *args.overrides]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "wall_seconds_including_startup": round(wall, 2),
        "median_seconds": {k.removeprefix("timing_s/"): round(statistics.median(r[k] for r in rows), 4) for k in phases},
        "median_tokens_per_second_per_rank": round(statistics.median(r["perf/throughput"] for r in rows), 1),
        "final_score_mean": rows[-1]["critic/score/mean"],
    }
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
