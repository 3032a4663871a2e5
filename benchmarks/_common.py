"""What the engine benchmarks share: a random Llama-style model of a preset size, the device's
name, and writing the result JSON from rank 0."""
from __future__ import annotations

import json
import platform
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

PRESETS = {  # hidden, intermediate, layers, heads, kv_heads, vocab
    "tiny": (64, 128, 2, 4, 2, 301),
    "small": (256, 704, 4, 8, 4, 4096),
    "1b": (2048, 5632, 16, 16, 8, 32000),
}


def random_llama(preset: str, dims, max_positions: int, tag: str) -> Path:
    """A random model of the preset's size under the temp dir (made once, by rank 0)."""
    from megarl.tools.make_tiny_model import make_tiny_model

    hidden, inter, layers, heads, kv, vocab = PRESETS[preset]
    model_dir = Path(tempfile.gettempdir()) / f"megarl_{tag}_{preset}"
    if dims.rank == 0 and not (model_dir / "config.json").exists():
        make_tiny_model("llama", model_dir, hidden=hidden, intermediate=inter, layers=layers, heads=heads, kv_heads=kv,
                        vocab_size=vocab, max_positions=max(max_positions, 64), init_std=0.02)
    dist.barrier()
    return model_dir


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or platform.machine()


def write_result(result: dict, out: str) -> None:
    """The result JSON to `out` (its folder made) and to stdout."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


def finish(result: dict, out: str, dims) -> int:
    """Rank 0 writes and prints the result; every rank then leaves the process group."""
    if dims.rank == 0:
        write_result(result, out)
    dist.barrier()
    dist.destroy_process_group()
    return 0
