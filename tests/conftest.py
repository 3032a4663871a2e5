"""Shared fixtures: tiny models of every family (built locally, never downloaded) and a torchrun helper."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe")

# Keep every test process single-threaded: the suite runs many ranks on two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def torchrun(nproc: int, args: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `torchrun --standalone --nproc_per_node nproc <args>`; fail the test with its output on error."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"torchrun {' '.join(args)} exited {proc.returncode}:\n{tail}")
    return proc


def make_model(out: Path, arch: str, **overrides) -> Path:
    from megarl.tools.make_tiny_model import make_tiny_model

    if not (out / "config.json").exists():
        make_tiny_model(arch, out, **overrides)
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny model per family. The vocabulary (301) is divisible by neither 2 nor 4, so TP pads
    it; llama ties its embeddings, the others do not."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        arch: make_model(root / arch, arch, vocab_size=301, tie=(arch == "llama"), seed=FAMILIES.index(arch))
        for arch in FAMILIES
    }


@pytest.fixture(scope="module")
def world_of_one():
    """ParallelDims(world_size=1) initialised on gloo in this process; env and groups restored after."""
    import torch.distributed as dist

    from megarl.parallel import ParallelDims, _free_port

    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    started = not dist.is_initialized()
    dims = ParallelDims(world_size=1).initialize()
    yield dims
    dims.destroy()
    if started:
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
