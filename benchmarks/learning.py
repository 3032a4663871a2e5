"""python benchmarks/learning.py --out FILE.json [--seed S] [--steps N] [--eval-every K] [--estimators gae,grpo] [--jobs 2]

Learning per sample, megarl against a textbook PPO (benchmarks/reference_ppo.py), in one run: the CPU
demo's task, model, batch and steps (configs/tiny_cpu.yaml) for each, greedy exact match on the 256
held-out prompts (megarl.tools.eval_exact_match with the run's banned tokens) every K steps,
against the number of sampled responses seen. megarl is run as a user runs it (launch/ppo.py, one
process; layouts give the same numbers), its checkpoints exported and measured; the reference
measures its own policy with the same function.

Writes {"config", "seed", "steps", "eval_every", "runs": {name: {"points": [{"step", "samples",
"exact_match", "score"}], "samples_to_0.9"}}} where samples_to_0.9 is the first measured point at or
above 0.9 (null: never within the steps). Runs go side by side, --jobs at a time.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
THRESHOLD = 0.9


def megarl_command(config: str, estimator: str, seed: int, steps: int, eval_every: int, run_dir: Path) -> list[str]:
    return [sys.executable, str(REPO / "launch" / "ppo.py"), "--config", config, f"algorithm.adv_estimator={estimator}",
            f"trainer.seed={seed}", f"trainer.total_steps={steps}", f"trainer.save_every_steps={eval_every}",
            f"trainer.run_dir={run_dir}", "trainer.resume=never", "tracking.mlflow=false", "tracking.progress_bar=false"]


def megarl_points(run_dir: Path, val_files: list[str]) -> list[dict]:
    """Exact match of each checkpoint of a finished run, with the step's rollout score."""
    import transformers
    import yaml

    from megarl.tools.eval_exact_match import exact_match

    transformers.utils.logging.disable_progress_bar()

    banned = tuple((yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"] or {}).get("banned_token_ids") or ())
    metrics = {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    points = []
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
        step = int(ckpt.name.split("_")[1])
        out = run_dir / f"hf_{step}"
        subprocess.run([sys.executable, "-m", "megarl.tools.export_hf", "--ckpt", str(ckpt), "--out", str(out)],
                       cwd=REPO, check=True, capture_output=True)
        m = metrics[step]
        points.append({"step": step, "exact_match": exact_match(str(out), val_files, banned_token_ids=banned)["exact_match"],
                       "score": m["critic/score/mean"]})
    return points


def samples_to(points: list[dict], threshold: float = THRESHOLD) -> int | None:
    return next((p["samples"] for p in points if p["exact_match"] >= threshold), None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="exact match against samples seen: megarl and a textbook PPO, side by side")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="default: the config's trainer.total_steps")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--estimators", default="gae,grpo", help="megarl's advantage estimators to run (comma-separated)")
    p.add_argument("--reference-head-inits", default="small",
                   help="value-head scales of the reference runs (comma-separated: small, trl; see reference_ppo.py)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from megarl.config import load_config

    cfg = load_config(args.config)
    steps = args.steps or cfg.trainer.total_steps
    per_step = cfg.data.prompts_per_step * cfg.rollout.samples_per_prompt
    with tempfile.TemporaryDirectory(prefix="megarl-learning-") as tmp:
        tmp = Path(tmp)
        jobs = {f"megarl_{e}": megarl_command(args.config, e, args.seed, steps, args.eval_every, tmp / e)
                for e in args.estimators.split(",")}
        for init in args.reference_head_inits.split(","):
            name = "reference_ppo" + ("" if init == "small" else f"_{init}_head")
            jobs[name] = [sys.executable, str(REPO / "benchmarks" / "reference_ppo.py"), "--config", args.config,
                          "--seed", str(args.seed), "--steps", str(steps), "--eval-every", str(args.eval_every),
                          "--head-init", init, "--out", str(tmp / f"{name}.json")]
        pending, running, logs = list(jobs.items()), [], {}
        while pending or running:
            while pending and len(running) < args.jobs:
                name, cmd = pending.pop(0)
                logs[name] = open(tmp / f"{name}.log", "w")
                running.append((name, subprocess.Popen(cmd, cwd=REPO, stdout=logs[name], stderr=subprocess.STDOUT)))
            name, proc = running.pop(0)
            if proc.wait() != 0:
                print((tmp / f"{name}.log").read_text()[-3000:], file=sys.stderr)
                print(f"learning: {name} failed (exit {proc.returncode})", file=sys.stderr)
                return 1
        runs = {}
        for name in jobs:
            if name.startswith("reference_ppo"):
                points = json.loads((tmp / f"{name}.json").read_text())["points"]
            else:
                points = megarl_points(tmp / name.removeprefix("megarl_"), [str(REPO / f) for f in cfg.data.val_files])
                points = [{**pt, "samples": pt["step"] * per_step} for pt in points]
            runs[name] = {"points": points, "samples_to_0.9": samples_to(points)}
            print(json.dumps({"run": name, "samples_to_0.9": runs[name]["samples_to_0.9"],
                              "exact_match": [pt["exact_match"] for pt in points]}))
    result = {"config": args.config, "seed": args.seed, "steps": steps, "eval_every": args.eval_every,
              "samples_per_step": per_step, "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
