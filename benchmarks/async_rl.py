"""Separate placement and the asynchronous schedule against colocated, on the same ranks.

    python benchmarks/async_rl.py --out benchmarks/results/async_rl_cpu.json [--steps 8] [key=value ...]

One run of four launches of the CPU demo (configs/tiny_cpu.yaml) on 2 processes with fixed-length
responses (rollout.ignore_eos): colocated-sync (DP 2, the ranks take turns), separate-sync (1
training + 1 rollout rank, K = 0) and separate-async (K = 1, 2). Writes samples/s of each (responses
over the summed step times after the warm-up step), the ratios separate_async_over_separate_sync and
separate_async_over_colocated_sync (the best K), each group's idle fraction (trainer: time waiting
for samples; rollout rank: 1 - generating time over the steps' time; colocated ranks do both phases
in turn, so the rollout phase's share of the step is reported for them), and the staleness seen.
The defaults make generation and training cost about the same on the split ranks; the measured
phase times are in the result so that balance can be checked.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_result  # benchmarks/_common.py

REPO = Path(__file__).resolve().parents[1]
# fixed-length responses, one update epoch: generation and training about equal on one rank each
DEFAULTS = {"rollout.ignore_eos": "true", "rollout.max_new_tokens": 12, "data.prompts_per_step": 16,
            "rollout.samples_per_prompt": 8, "actor.ppo_epochs": 1, "actor.ppo_mini_batches": 2,
            "rollout.verify_weights": "false", "tracking.loggers": "[console,jsonl]", "tracking.progress_bar": "false",
            "trainer.save_every_steps": 0, "trainer.val_every_steps": 0}
MODES = {"colocated_sync": {},
         "separate_sync": {"rollout.placement": "separate", "rollout.num_ranks": 1},
         "separate_async_k1": {"rollout.placement": "separate", "rollout.num_ranks": 1, "async.max_staleness": 1},
         "separate_async_k2": {"rollout.placement": "separate", "rollout.num_ranks": 1, "async.max_staleness": 2}}


def run(mode: str, root: Path, steps: int, extra: list[str]) -> dict:
    run_dir = root / mode
    overrides = {**DEFAULTS, **MODES[mode], "trainer.run_dir": run_dir, "trainer.total_steps": steps,
                 "model.path": root / "model", "data.train_files": f"[{root / 'train.parquet'}]",
                 "data.val_files": f"[{root / 'test.parquet'}]"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "launch/ppo.py",
           "--config", "configs/tiny_cpu.yaml", *[f"{k}={v}" for k, v in overrides.items()], *extra]
    subprocess.run(cmd, cwd=REPO, check=True, env=dict(os.environ, PYTHONWARNINGS="ignore"), stdout=subprocess.DEVNULL)
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in r]
    measured = rows[1:]  # after the warm-up step
    seconds = sum(r["timing_s/step"] for r in measured)
    import yaml

    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    responses = len(measured) * resolved["data"]["prompts_per_step"] * resolved["rollout"]["samples_per_prompt"]
    out = {"samples_per_s": round(responses / seconds, 2), "seconds_per_step": round(seconds / len(measured), 4),
           "gen_s_per_step": round(sum(r["timing_s/gen"] for r in measured) / len(measured), 4),
           "update_s_per_step": round(sum(r.get("timing_s/update_actor", 0) + r.get("timing_s/update_critic", 0)
                                          for r in measured) / len(measured), 4)}
    if "async/trainer_wait_s" in rows[-1]:
        busy = rows[-1]["async/rollout_busy_s"] - rows[0]["async/rollout_busy_s"]
        out["idle_fraction"] = {"train": round(sum(r["async/trainer_wait_s"] for r in measured) / seconds, 4),
                                "rollout": round(max(0.0, 1 - busy / seconds), 4)}
        out["staleness"] = {"max": max(r["async/staleness_max"] for r in rows),
                            "mean": round(sum(r["async/staleness_mean"] for r in measured) / len(measured), 4),
                            "dropped": sum(r["async/dropped_stale"] for r in rows)}
    else:
        out["rollout_phase_share"] = round(sum(r["timing_s/gen"] for r in measured) / seconds, 4)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*", help="key=value overrides for every launch")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    from megarl.data.prepare import prepare_arithmetic

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare_arithmetic(root, "copy", 3, 2048, 64)
        modes = {mode: run(mode, root, args.steps, args.overrides) for mode in MODES}
    best = max(("separate_async_k1", "separate_async_k2"), key=lambda m: modes[m]["samples_per_s"])
    result = {
        "command": " ".join(["python", "benchmarks/async_rl.py", f"--steps {args.steps}", *args.overrides]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "load_average_at_end": os.getloadavg()[0]},
        "settings": {**DEFAULTS, "nproc": 2, "steps": args.steps},
        "modes": modes,
        "best_async": best,
        "separate_async_over_separate_sync": round(modes[best]["samples_per_s"] / modes["separate_sync"]["samples_per_s"], 3),
        "separate_async_over_colocated_sync": round(modes[best]["samples_per_s"] / modes["colocated_sync"]["samples_per_s"], 3),
    }
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
