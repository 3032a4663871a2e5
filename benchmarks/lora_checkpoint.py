"""python benchmarks/lora_checkpoint.py [--ranks 32 8] --out benchmarks/results/lora_checkpoint_cpu.json

Checkpoint size under LoRA against full fine-tuning: the CPU LoRA demo (configs/tiny_cpu_lora.yaml,
GRPO, adapters on every linear layer) run for one PPO step on one process with a checkpoint at step
1, with `actor.lora.rank=0` (every weight trains), then at each rank of --ranks (the config's 32, and
8 as benchmarks/lora_memory.py uses: at hidden 64 a rank-32 adapter, 2r(in+out), is larger than the
64 x 64 weight it adapts, so the ratio there says little about a real model). A LoRA checkpoint holds
the adapters and their Adam state only, with a reference to the base (megarl.engine.adapter_checkpoint);
a full one the weights and their Adam state. The bytes on disk of each checkpoint's `actor/`
directory and of the whole step directory, and their ratios, are written out.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _common import write_result  # noqa: E402

CONFIG = "configs/tiny_cpu_lora.yaml"
SMALL = ["trainer.total_steps=1", "trainer.save_every_steps=1", "data.prompts_per_step=4", "rollout.samples_per_prompt=4",
         "trainer.resume=never", "tracking.mlflow=false", "tracking.progress_bar=false"]


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(run_dir: Path, extra: list[str]) -> dict[str, int]:
    cmd = [sys.executable, str(REPO / "launch" / "ppo.py"), "--config", CONFIG, *SMALL, f"trainer.run_dir={run_dir}", *extra]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=900)
    step = run_dir / "checkpoints" / "step_00000001"
    return {"actor": _bytes(step / "actor"), "step_dir": _bytes(step)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ranks", type=int, nargs="+", default=[32, 8], help="adapter ranks (32: the config's; alpha = 2 x rank)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        full = measure(Path(tmp) / "full", ["actor.lora.rank=0"])
        lora = {r: measure(Path(tmp) / f"lora{r}", [f"actor.lora.rank={r}", f"actor.lora.alpha={2 * r}"]) for r in args.ranks}
    result = {
        "what": "bytes on disk of a step-1 checkpoint, LoRA (adapters + their Adam state + base_ref.json) vs every weight trained",
        "config": f"{CONFIG} (llama, hidden 64, ffn 256, 2 layers, vocab of digits), 1 process, float32, Adam",
        "lora": {"ranks": args.ranks, "alpha": "2 x rank", "target_modules": "all linear layers of the decoder"},
        "command": f"python benchmarks/lora_checkpoint.py --ranks {' '.join(map(str, args.ranks))} --out ...",
        "base_model_bytes": _bytes_of_base(),
        "full_bytes": full,
        "lora_bytes": {f"rank{r}": b for r, b in lora.items()},
        "lora_over_full": {f"rank{r}": {k: b[k] / full[k] for k in full} for r, b in lora.items()},
    }
    write_result(result, args.out)
    return 0


def _bytes_of_base() -> int:
    """The base model's weight files (the demo makes it under runs/models on its first start)."""
    import yaml

    model = REPO / yaml.safe_load((REPO / CONFIG).read_text())["model"]["path"]
    return sum(f.stat().st_size for f in model.glob("*.safetensors"))


if __name__ == "__main__":
    sys.exit(main())
