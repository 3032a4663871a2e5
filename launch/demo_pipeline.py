"""The RLHF pipeline on the CPU demo task (`make demo-pipeline`), each stage a torchrun of N processes:

  1. data     launch/prepare_data.py: SFT rows (task rows 0..3999), preference pairs (rows 4000..7999: the answer
              against a wrong one), both with the 256 held-out prompts of the PPO demo as their test split
  2. sft      launch/sft.py, configs/tiny_cpu_sft.yaml, from the tiny random model
  3. rm       launch/reward_model.py, configs/tiny_cpu_rm.yaml, from the SFT model
  4. ppo      launch/ppo.py, configs/tiny_cpu.yaml from the SFT model, reward.kind=model with the reward model
  5. distill  launch/ppo.py, configs/tiny_cpu_distill.yaml: that config's smaller student (1 layer of the
              teacher's 2) from the PPO policy, the teacher scoring the student's samples

After each stage its export is measured: greedy exact match on the held-out prompts (megarl.tools.
eval_exact_match; the student's also as a fraction of its teacher's), for the reward model pairwise accuracy
on held-out pairs, scored by transformers and by megarl (megarl.tools.eval_reward_model). Each stage's wall
time and figure go to <out>/pipeline.json. Rerunning resumes each finished stage (trainer.resume=auto), so
only the exports and measurements run again.

    python launch/demo_pipeline.py [--nproc 2] [--out runs/pipeline] [--seed N]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = "runs/data/arithmetic"  # the PPO demo's data (its config writes it on first start)


def run(cmd: list[str]) -> str:
    """Run a command from the repository root; its stdout; exit with its code on failure."""
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        print(proc.stdout[-4000:])
        sys.exit(f"demo_pipeline: {' '.join(cmd[:4])} ... exited {proc.returncode}")
    return proc.stdout


def last_checkpoint(run_dir: str) -> str:
    return str(sorted((REPO / run_dir / "checkpoints").glob("step_*"))[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default="runs/pipeline")
    p.add_argument("--ppo-steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=None,
                   help="every stage's trainer.seed and tiny-model init seed (default: each config's own)")
    args = p.parse_args(argv)
    # a seed for the data order, sampling and the random init of the models made from scratch (SFT's start, the student)
    seeded = [] if args.seed is None else [f"trainer.seed={args.seed}", f"model.make_tiny.seed={args.seed}"]
    py, out = sys.executable, args.out
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    results: dict[str, dict] = {}

    def stage(name: str, train: list[str] | None, measure):
        started = time.perf_counter()
        if train is not None:
            run(train)
        results[name] = {"wall_s": round(time.perf_counter() - started, 1), **measure()}
        print(f"== {name}: {json.dumps(results[name])}", flush=True)
        (REPO / out).mkdir(parents=True, exist_ok=True)
        (REPO / out / "pipeline.json").write_text(json.dumps(results, indent=1))

    def exact_match(model_dir: str) -> dict:
        figure = json.loads(run([py, "-m", "megarl.tools.eval_exact_match", "--model", model_dir,
                                 "--data", f"{PROMPTS}/test.parquet"]).strip().splitlines()[-1])
        return {"exact_match": figure["exact_match"]}

    def export(run_dir: str, hf_dir: str) -> str:
        run([py, "-m", "megarl.tools.export_hf", "--ckpt", last_checkpoint(run_dir), "--out", hf_dir])
        return hf_dir

    stage("data", [py, "launch/prepare_data.py", "arithmetic", "--out", PROMPTS, "--val-size", "256"], lambda: {})
    for fmt, offset in (("sft", 0), ("preference", 4000)):
        run([py, "launch/prepare_data.py", fmt, "--arithmetic", "--out", f"{out}/data/{fmt}", "--train-size", "4000",
             "--train-offset", str(offset), "--val-size", "256"])

    sft_dir, rm_dir, ppo_dir = f"{out}/sft", f"{out}/rm", f"{out}/ppo"
    stage("sft", [*torchrun, "launch/sft.py", "--config", "configs/tiny_cpu_sft.yaml", f"trainer.run_dir={sft_dir}",
                  f"data.train_files=[{out}/data/sft/train.parquet]", f"data.val_files=[{out}/data/sft/test.parquet]", *seeded],
          lambda: exact_match(export(sft_dir, f"{sft_dir}/hf")))
    stage("rm", [*torchrun, "launch/reward_model.py", "--config", "configs/tiny_cpu_rm.yaml", f"trainer.run_dir={rm_dir}",
                 f"model.path={sft_dir}/hf", "model.make_tiny.enable=false",
                 f"data.train_files=[{out}/data/preference/train.parquet]",
                 f"data.val_files=[{out}/data/preference/test.parquet]", *seeded],
          lambda: json.loads(run([py, "-m", "megarl.tools.eval_reward_model", "--model", export(rm_dir, f"{rm_dir}/hf"),
                                  "--data", f"{out}/data/preference/test.parquet"]).strip().splitlines()[-1]))
    # PPO from the SFT model against the learned reward model: GRPO as the demo, a tenth of its learning rate
    # (the policy already answers; the demo's rate is for learning from scratch)
    stage("ppo", [*torchrun, "launch/ppo.py", "--config", "configs/tiny_cpu.yaml", f"trainer.run_dir={ppo_dir}",
                  f"model.path={sft_dir}/hf", "model.make_tiny.enable=false", "reward.kind=model",
                  f"reward.model_path={rm_dir}/hf", f"trainer.total_steps={args.ppo_steps}", "trainer.save_every_steps=10",
                  "actor.optim.lr=5e-5", "actor.optim.min_lr=5e-6", *seeded],
          lambda: exact_match(export(ppo_dir, f"{ppo_dir}/hf")))

    # The student is the distillation config's own tiny model (1 layer of the teacher's 2, same width), made in
    # the run's directory on first start. (A half-width 2-layer student learned far slower: exact match 0.01
    # after the same 40 steps.)
    student, distill_dir = f"{out}/student", f"{out}/distill"
    teacher = results["ppo"]["exact_match"]

    def distilled() -> dict:
        figure = exact_match(export(distill_dir, f"{distill_dir}/hf"))
        return {**figure, "of_teacher": figure["exact_match"] / max(teacher, 1e-9)}

    stage("distill", [*torchrun, "launch/ppo.py", "--config", "configs/tiny_cpu_distill.yaml",
                      f"trainer.run_dir={distill_dir}", f"model.path={student}",
                      f"algorithm.distill.teacher_path={ppo_dir}/hf", *seeded], distilled)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
