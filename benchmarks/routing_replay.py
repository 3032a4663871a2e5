"""Train/rollout log-prob gap of a tiny MoE with and without routing replay (issue 14, item 4).

    python benchmarks/routing_replay.py [--out DIR] [--steps 3]

Runs launch/ppo.py (one process, hf rollout engine, the CPU demo task) on a tiny qwen3_moe in
four settings, float32 and bfloat16, each with actor.routing_replay off and on, and prints
verl's training/rollout_probs_diff_mean / _max per step. Two models:

- `random`: the make_tiny_model default (4 experts, top-2), random routers;
- `near-tie`: 6 experts, top-2, each layer's router rows in two groups of three rows that differ
  by ~1e-7 relative, so which two of the winning three a token takes is decided by rounding:
  exactly the tokens whose routes differ between two implementations of the same weights.

Routers are frozen (model.freeze_router) so the ties survive the updates. Nothing is asserted
here; tests/moe/test_moe_routing.py holds the checks.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def make_model(out: Path, near_tie: bool) -> Path:
    from safetensors.torch import load_file, save_file

    from megarl.tools.make_tiny_model import make_tiny_model

    if (out / "config.json").exists():
        return out
    make_tiny_model("qwen3_moe", out, tokenizer="digits", experts=6 if near_tie else 4, topk=2, init_std=0.02)
    if near_tie:
        weights = load_file(str(out / "model.safetensors"))
        g = torch.Generator().manual_seed(0)
        for name in sorted(weights):
            if name.endswith("mlp.gate.weight"):
                w = weights[name]
                for group in (0, 3):
                    base = w[group].clone()
                    for j in range(3):
                        w[group + j] = base * (1 + 1e-7 * torch.randn(base.shape, generator=g))
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def run(root: Path, model: Path, dtype: str, replay: bool, steps: int) -> list[dict]:
    from megarl.data.prepare import prepare_arithmetic

    data = root / "data"
    if not (data / "train.parquet").exists():
        prepare_arithmetic(data, "copy", 3, 512, 16)
    run_dir = root / f"{model.name}-{dtype}-{'replay' if replay else 'own'}"
    overrides = {
        "model.path": model, "model.dtype": dtype, "model.freeze_router": "true", "model.sequence_packing": "true",
        "data.train_files": f"[{data / 'train.parquet'}]", "data.val_files": "[]", "data.prompts_per_step": 16,
        "rollout.samples_per_prompt": 4, "actor.ppo_mini_batches": 2, "actor.ppo_epochs": 1,
        "actor.routing_replay": str(replay).lower(), "rollout.verify_weights": "false",
        "trainer.total_steps": steps, "trainer.save_every_steps": 0, "trainer.val_every_steps": 0,
        "trainer.run_dir": run_dir, "trainer.resume": "never", "tracking.progress_bar": "false",
    }
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "launch/ppo.py", "--config", "configs/tiny_cpu.yaml",
                    *(f"{k}={v}" for k, v in overrides.items())], cwd=REPO, env=env, check=True, capture_output=True)
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in r]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/routing_replay")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--models", nargs="+", default=["random", "near-tie"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = p.parse_args()
    root = Path(args.out).resolve()
    print("model     dtype     replay  step  rollout_probs_diff_mean  rollout_probs_diff_max")
    for kind in args.models:
        model = make_model(root / f"model-{kind}", near_tie=kind == "near-tie")
        for dtype in args.dtypes:
            for replay in (False, True):
                for r in run(root, model, dtype, replay, args.steps):
                    print(f"{kind:9} {dtype:9} {str(replay):7} {r['step']:4}  {r['training/rollout_probs_diff_mean']:23.3e}"
                          f"  {r['training/rollout_probs_diff_max']:22.3e}", flush=True)


if __name__ == "__main__":
    main()
