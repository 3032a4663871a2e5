"""megarl's GRPO step against TRL's GRPOTrainer on the same work, side by side.

    python benchmarks/vs_trl.py --out benchmarks/results/vs_trl_cpu.json [--rounds 2] [--steps 6]

One process each, the CPU demo's model, data and batch geometry (configs/tiny_cpu.yaml: 32 prompts x
16 samples, 4 epochs x 4 mini-batches = 16 optimizer steps per PPO step, clip 0.2, token-mean loss,
group-normalised advantages, lr 5e-4 with the cosine to 5e-5, no KL). megarl runs launch/ppo.py
through benchmarks/_ppo_probe.py (CPU seconds per phase); TRL runs benchmarks/_trl_grpo.py in its
own virtual environment, which this script makes on first use (`--venv`, runs/trl-venv: TRL with
the local CPU torch pinned, as the Makefile makes the vLLM tier's). The two alternate, the order
flipping every round, so a change in the machine's load hits both.

Written: the ratio of median PPO-step times, megarl over TRL, in CPU seconds of the process (the
figure to read on a shared machine, where each side runs one thread) and in wall seconds; the cost
per optimizer step of each (megarl: its actor update over 16; TRL: its whole step over 16, generation
included, as TRL has no separate update phase); the machine's load average before and after.
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

REPO = Path(__file__).resolve().parents[1]
TRL_VERSION = "1.16.0"
TORCH_VERSION = "2.13.0"  # the CPU build on local disk (an unpinned torch pulls a CUDA one)
WARMUP = 1  # PPO steps dropped from each run
OPTIMIZER_STEPS = 16  # actor.ppo_epochs x actor.ppo_mini_batches of configs/tiny_cpu.yaml


def ensure_trl_venv(venv: Path) -> Path:
    """TRL's interpreter, in its own venv (TRL pins transformers/accelerate of its own choosing)."""
    python = venv / "bin" / "python"
    marker = venv / ".installed"
    if marker.is_file() and marker.read_text().strip() == TRL_VERSION:
        return python
    print(f"vs_trl: installing TRL {TRL_VERSION} into {venv} (first use, a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}", f"trl=={TRL_VERSION}"], check=True)
    marker.write_text(TRL_VERSION + "\n")
    return python


def _env() -> dict:
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def run_megarl(tmp: Path, steps: int, model: Path, data: Path) -> dict:
    run_dir = tmp / "megarl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "benchmarks/_ppo_probe.py",
           "--config", "configs/tiny_cpu.yaml", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
           "trainer.save_every_steps=0", f"trainer.val_every_steps={steps + 1}", "tracking.progress_bar=false",
           "tracking.mlflow=false", "trainer.resume=never", f"model.path={model}",
           f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'test.parquet'}]"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"megarl run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "event" not in r][WARMUP:]
    cpu = [sum(v for k, v in r.items() if k.startswith("bench/cpu_s/")) for r in rows]
    return {"step_wall_s": [r["timing_s/step"] for r in rows], "step_cpu_s": cpu,
            "update_actor_cpu_s": [r["bench/cpu_s/update_actor"] for r in rows],
            "update_actor_wall_s": [r["timing_s/update_actor"] for r in rows]}


def run_trl(python: Path, tmp: Path, steps: int, model: Path, data: Path) -> dict:
    out = tmp / "trl.json"
    proc = subprocess.run([str(python), "benchmarks/_trl_grpo.py", "--model", str(model), "--train", str(data / "train.parquet"),
                           "--steps", str(steps), "--out", str(out)], cwd=REPO, env=_env(), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"TRL run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    r = json.loads(out.read_text())
    return {"step_wall_s": r["step_wall_s"][WARMUP:], "step_cpu_s": r["step_cpu_s"][WARMUP:]}


def demo_model_and_data() -> tuple[Path, Path]:
    """The suite's copies of the demo's data (made when missing) and model (made by megarl's first
    run, model.make_tiny: every round starts with megarl when it is missing)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.path.insert(0, str(REPO))
    from suite import BENCH_DATA, prepare_bench_data  # benchmarks/suite.py

    prepare_bench_data()
    return REPO / "runs" / "bench" / "tiny-llama-digits", BENCH_DATA


def measure(rounds: int, steps: int, venv: Path) -> dict:
    python = ensure_trl_venv(venv)
    model, data = demo_model_and_data()
    load_before = list(os.getloadavg())
    sides = {"megarl": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            first_megarl = r % 2 == 0 or not (model / "config.json").is_file()
            for side in (("megarl", "trl") if first_megarl else ("trl", "megarl")):
                d = Path(tmp) / f"{side}{r}"
                d.mkdir()
                sides[side].append(run_megarl(d, steps, model, data) if side == "megarl" else run_trl(python, d, steps, model, data))
    flat = lambda side, key: [x for run in sides[side] for x in run[key]]  # noqa: E731
    med = {side: {key: statistics.median(flat(side, key)) for key in ("step_cpu_s", "step_wall_s")} for side in sides}
    megarl_update = statistics.median(flat("megarl", "update_actor_cpu_s"))
    return {
        "ratio_megarl_over_trl_cpu": med["megarl"]["step_cpu_s"] / med["trl"]["step_cpu_s"],
        "ratio_megarl_over_trl_wall": med["megarl"]["step_wall_s"] / med["trl"]["step_wall_s"],
        # Per round: the two runs are neighbours in time, so their ratio is the least exposed to load swings.
        "ratio_cpu_per_round": [statistics.median(m["step_cpu_s"]) / statistics.median(t["step_cpu_s"])
                                for m, t in zip(sides["megarl"], sides["trl"])],
        "median_step_s": med,
        "per_optimizer_step_cpu_s": {"megarl_update_actor": megarl_update / OPTIMIZER_STEPS,
                                     "megarl_whole_step": med["megarl"]["step_cpu_s"] / OPTIMIZER_STEPS,
                                     "trl_whole_step": med["trl"]["step_cpu_s"] / OPTIMIZER_STEPS},
        "runs": sides,
        "load_average_1_5_15": {"before": load_before, "after": list(os.getloadavg())},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (each runs both sides once)")
    p.add_argument("--steps", type=int, default=5, help=f"PPO steps per run (the first {WARMUP} dropped)")
    p.add_argument("--venv", type=Path, default=REPO / "runs" / "trl-venv", help="TRL's virtual environment (made if missing)")
    args = p.parse_args()
    result = measure(args.rounds, args.steps, args.venv)
    result.update({
        "command": f"python benchmarks/vs_trl.py --rounds {args.rounds} --steps {args.steps} --out {args.out}",
        "geometry": "configs/tiny_cpu.yaml at one process: 32 prompts x 16 samples, 4 epochs x 4 mini-batches, 4 new tokens",
        "trl": TRL_VERSION, "machine": {"processor": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "note": "CPU seconds of each process (one thread each), medians over the steps after the first of every run",
    })
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("ratio_megarl_over_trl_cpu", "ratio_megarl_over_trl_wall", "per_optimizer_step_cpu_s",
                                             "load_average_1_5_15")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
