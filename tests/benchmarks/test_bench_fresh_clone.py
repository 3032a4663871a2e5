"""`make bench` on a fresh clone: the suite prepares its own data (issue 28: it once passed only where
runs/bench/arithmetic already existed, because data.auto_prepare rightly refuses to create a data file
given on the command line)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _fresh_clone(dest: Path) -> None:
    """The tracked files as they are in the working tree: what a clone of this commit holds, with no
    runs/ directory and no prepared data."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_make_bench_passes_in_a_fresh_clone(tmp_path):
    clone = tmp_path / "clone"
    _fresh_clone(clone)
    assert not (clone / "runs").exists()
    # The clone uses this interpreter's environment: `-o` keeps make from rebuilding the venv.
    if not (Path(sys.prefix) / "pyvenv.cfg").is_file():
        pytest.skip("needs the project's virtual environment (make setup)")
    os.symlink(sys.prefix, clone / ".venv")
    # BENCH_TRL=0: no TRL venv install here (benchmarks/vs_trl.py makes it on first use; minutes of downloads).
    env = dict(os.environ, PYTHONPATH=str(clone), OMP_NUM_THREADS="1", BENCH_TRL="0")
    proc = subprocess.run(["make", "-o", ".venv/.installed", "bench", "BENCH_STEPS=4"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (clone / "runs" / "bench" / "arithmetic" / "train.parquet").is_file()
    assert (clone / "runs" / "bench" / "suite.json").is_file()
