"""Supervised fine-tuning (SFT) with megarl, on the PPO trainer's engine and layouts (docs/sft_rm.md).

    torchrun --standalone --nproc_per_node N launch/sft.py --config configs/tiny_cpu_sft.yaml [key=value ...]
    python launch/sft.py --config configs/X.yaml [key=value ...]          # one process

Configuration mistakes and bad data rows are reported in one line with exit code 2. The run's life is
megarl/run.py's (as for launch/ppo.py); the steps are megarl/supervised/trainer.py's.
"""
from __future__ import annotations

import sys
from pathlib import Path

# Run from a checkout without installing: make `megarl` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.supervised.launch import main  # noqa: E402  (light: the heavy imports follow the config check)

if __name__ == "__main__":  # the guard matters: Megatron's checkpoint writer spawns processes
    sys.exit(main("sft"))
