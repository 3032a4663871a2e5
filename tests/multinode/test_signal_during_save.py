"""A signal during a checkpoint save: SIGTERM lets the save finish (the handler only raises a flag) and
every rank then agrees to stop; SIGKILL half-way leaves the previous checkpoint the one resume uses."""
from __future__ import annotations

import datetime
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import spawn
from megarl.checkpointing import checkpoint
from megarl.runtime.preemption import PreemptionWatch

pytestmark = pytest.mark.multiprocess


class _Engine:
    def __init__(self, signum: int | None):
        self.signum = signum

    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        rank = dist.get_rank()
        Path(path, f"first_half.{rank}").write_text("x")
        if self.signum is not None and rank == 1:
            os.kill(os.getpid(), self.signum)
            time.sleep(0.5)  # a default SIGTERM would end the process here
        Path(path, f"second_half.{rank}").write_text("x")


class _Trainer:
    def __init__(self, step: int, signum: int | None = None):
        self.step, self.engine = step, _Engine(signum)

    def checkpointed_engines(self):
        return {"actor": self.engine}

    def state_dict(self):
        return {"step": self.step}


def _save_twice(rank: int, port: int, run_dir: str, signum: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    watch = PreemptionWatch().install()
    checkpoint.save(_Trainer(1), run_dir, 1)
    checkpoint.save(_Trainer(2, signum), run_dir, 2)  # rank 1 is signalled in the middle of writing its shard
    Path(out, f"rank{rank}.json").write_text(json.dumps({"agreed": watch.agreed()}))
    dist.destroy_process_group()


def test_sigterm_during_save_completes_it_and_all_ranks_stop(tmp_path):
    spawn(_save_twice, 2, str(tmp_path / "run"), signal.SIGTERM, str(tmp_path))
    latest = checkpoint.latest_checkpoint(tmp_path / "run")
    assert latest is not None and latest.name == "step_00000002"
    assert (latest / "actor" / "second_half.1").is_file() and (latest / "trainer.pt").is_file()
    assert [json.loads((tmp_path / f"rank{r}.json").read_text())["agreed"] for r in (0, 1)] == ["SIGTERM", "SIGTERM"]


def test_sigkill_during_save_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(Exception):  # noqa: B017 (whichever error the spawner raises for a killed rank)
        spawn(_save_twice, 2, str(tmp_path / "run"), signal.SIGKILL, str(tmp_path))
    root = tmp_path / "run" / "checkpoints"
    assert checkpoint.latest_checkpoint(tmp_path / "run") == root / "step_00000001"
    assert (root / "step_00000001" / "trainer.pt").is_file()
    assert any(p.name.startswith("step_00000002.tmp") for p in root.iterdir())  # the killed save's leftovers
