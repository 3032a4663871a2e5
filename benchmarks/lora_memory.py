"""python benchmarks/lora_memory.py --out benchmarks/results/lora_memory_cpu.json [--rank 8]

Training-state memory under LoRA against full fine-tuning, as the trainer measures it: the CPU
demo (configs/tiny_cpu.yaml, GAE with the critic so both roles train) run for one PPO step with
every weight trained, then with `actor.lora.rank` = `critic.lora.rank` = R, side by side; the
step's `memory/<role>/{param,trainable_param,grad,optimizer_state}_bytes` (megarl/trainer.py) are
read from metrics.jsonl and their LoRA / full ratios written out. The ratios of gradients and
optimizer state follow the adapters' share of the parameters; the parameters themselves stay
(the frozen base plus the adapters).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _common import write_result  # noqa: E402

PARTS = ("param", "trainable_param", "grad", "optimizer_state")
SMALL = ["trainer.total_steps=1", "data.prompts_per_step=4", "rollout.samples_per_prompt=4", "algorithm.adv_estimator=gae",
         "trainer.save_every_steps=0", "trainer.resume=never", "tracking.mlflow=false", "tracking.progress_bar=false"]


def measure(run_dir: Path, extra: list[str]) -> dict[str, float]:
    cmd = [sys.executable, str(REPO / "launch" / "ppo.py"), "--config", "configs/tiny_cpu.yaml", *SMALL,
           f"trainer.run_dir={run_dir}", *extra]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=900)
    row = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"event"' not in line][-1]
    return {f"{role}/{part}": row[f"memory/{role}/{part}_bytes"] for role in ("actor", "critic") for part in PARTS}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        full = measure(Path(tmp) / "full", [])
        lora = measure(Path(tmp) / "lora", [f"{role}.lora.rank={args.rank}" for role in ("actor", "critic")]
                       + [f"{role}.lora.alpha={2 * args.rank}" for role in ("actor", "critic")])
    result = {
        "what": "training-state bytes per rank after one PPO step (GAE + critic), LoRA vs every weight trained",
        "config": "configs/tiny_cpu.yaml (hidden 64, ffn 256, 2 layers), 1 process, float32, Adam",
        "lora": {"rank": args.rank, "alpha": 2 * args.rank, "target_modules": "all linear layers of the decoder"},
        "command": f"python benchmarks/lora_memory.py --rank {args.rank} --out ...",
        "full_bytes": full, "lora_bytes": lora,
        "lora_over_full": {k: lora[k] / full[k] for k in full},
    }
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
