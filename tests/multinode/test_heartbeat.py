"""A stalled rank is named, with its phase, within trainer.collective_timeout_s (megarl/runtime/heartbeat.py)."""
from __future__ import annotations

import datetime
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from conftest import spawn
from megarl.runtime.heartbeat import STALL_EXIT_CODE, Heartbeat

TIMEOUT_S = 3.0


class _DictStore:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


def test_verdicts_on_hand_made_records():
    beat = Heartbeat(_DictStore(), rank=0, world_size=4, timeout_s=10)
    beat.enter("timing_s/update_actor", step=3)  # seq 1, phase 'update'
    records = {1: {"beat": 5, "phase": "update", "step": 3, "seq": 1},
               2: {"beat": 5, "phase": "generate", "step": 3, "seq": 0},
               3: {"beat": "finished", "phase": "save", "step": 3, "seq": 1}}
    t0 = beat.phase_since
    assert beat.check(records, t0 + 1, started=t0) is None
    assert beat.check(records, t0 + 9, started=t0) is None  # rank 2 is behind, but not for 10 s yet
    records[1]["beat"] = 6  # rank 1 beats; rank 2's beat stays at 5 (frozen) and it is behind
    message = beat.check(records, t0 + 11, started=t0)
    assert message == ("megarl: rank 0 waited 11 s in phase 'update' of step 3 (trainer.collective_timeout_s=10); "
                       "silent (no heartbeat for 10 s): rank 2 (last in phase 'generate' of step 3)")


def test_all_ranks_in_one_long_phase_is_not_a_stall():
    beat = Heartbeat(_DictStore(), rank=0, world_size=2, timeout_s=10)
    beat.enter("timing_s/gen", step=1)
    t0 = beat.phase_since
    for i in range(30):  # 30 s in 'generate' on both ranks, rank 1's heartbeat alive
        assert beat.check({1: {"beat": i, "phase": "generate", "step": 1, "seq": 1}}, t0 + i, started=t0) is None


# Separate placement: a rollout rank runs another program (its phases do not line up with the
# trainer's), so it is judged apart: named when it is silent, or when a training rank has waited
# for samples for the timeout while the rollout rank sat in one request as long.


def test_a_rollout_rank_stuck_in_a_request_is_named():
    beat = Heartbeat(_DictStore(), rank=0, world_size=2, timeout_s=10, rollout_ranks=(1,))
    beat.enter("timing_s/gen", step=4)  # the trainer waits for samples
    t0 = beat.phase_since
    stuck = {1: {"beat": 1, "phase": "generate", "step": 0, "seq": 7}}
    for i in range(10):  # beats keep coming (the thread lives) but the request never ends
        assert beat.check({1: {**stuck[1], "beat": i}}, t0 + i, started=t0) is None
    message = beat.check({1: {**stuck[1], "beat": 11}}, t0 + 11, started=t0)
    assert message is not None and "stalled: rank 1 (last in phase 'generate'" in message and "phase 'generate' of step 4" in message


def test_a_busy_rollout_rank_and_a_training_rank_ahead_are_not_a_stall():
    beat = Heartbeat(_DictStore(), rank=0, world_size=2, timeout_s=10, rollout_ranks=(1,))
    beat.enter("timing_s/gen", step=4)
    t0 = beat.phase_since
    for i in range(30):  # request after request: its seq moves, whatever the trainer's seq is
        assert beat.check({1: {"beat": i, "phase": "generate" if i % 2 else "wait", "step": 0, "seq": i}}, t0 + i, started=t0) is None
    beat.enter("timing_s/update_actor", step=4)  # training long while the rollout rank waits: normal
    t1 = beat.phase_since
    for i in range(30):
        assert beat.check({1: {"beat": 100 + i, "phase": "wait", "step": 0, "seq": 30}}, t1 + i, started=t0) is None


def test_a_silent_rollout_rank_is_named():
    beat = Heartbeat(_DictStore(), rank=0, world_size=2, timeout_s=10, rollout_ranks=(1,))
    t0 = beat.phase_since
    record = {1: {"beat": 3, "phase": "wait", "step": 0, "seq": 2}}
    assert beat.check(record, t0 + 1, started=t0) is None
    message = beat.check(record, t0 + 12, started=t0)
    assert message is not None and "silent" in message and "rank 1 (last in phase 'wait'" in message


def _stalling_world(rank: int, port: int, out_dir: str, mode: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))

    def report(message):
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(message)
        os._exit(STALL_EXIT_CODE)

    beat = Heartbeat(store, rank, 2, timeout_s=TIMEOUT_S, interval_s=0.25, on_stall=report).start()
    x = torch.ones(1)
    beat.enter("timing_s/sync", step=1)
    dist.all_reduce(x)
    beat.enter("timing_s/gen")
    if rank == 1:
        if mode == "frozen":
            time.sleep(1.0)  # (a few beats publish 'generate')
            beat._stop.set()  # then the whole process stops: its heartbeat too
        time.sleep(120)  # stuck in generate: rank 0 waits for it in the next collective
    beat.enter("timing_s/old_log_prob")
    start = time.monotonic()
    dist.all_reduce(x)  # never returns: rank 1 never arrives
    with open(os.path.join(out_dir, "rank0-returned.txt"), "w") as f:
        f.write(f"{time.monotonic() - start}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode,verdict", [("stuck", r"stalled: rank 1 \(last in phase 'generate' of step 1\)"),
                                          ("frozen", r"stalled: rank 1 \(last in phase 'generate' of step 1, its heartbeat stopped \d s ago\)")])
def test_a_stalled_rank_is_named_with_its_phase(tmp_path, mode, verdict):
    with pytest.raises(Exception, match=f"exit code {STALL_EXIT_CODE}|exited with exit code|{STALL_EXIT_CODE}"):
        spawn(_stalling_world, 2, str(tmp_path), mode)
    message = (tmp_path / "rank0.txt").read_text()
    assert message.startswith("megarl: rank 0 waited ") and "in phase 'forward' of step 1" in message
    assert re.search(verdict + "$", message), message
    waited = float(message.split("waited ")[1].split(" s")[0])
    assert TIMEOUT_S <= waited < 120  # named after the timeout, long before rank 1 would have come back
    assert not (tmp_path / "rank0-returned.txt").exists()


@pytest.mark.slow
def test_a_frozen_rank_in_a_training_run_is_named(tmp_path):
    """The trainer wiring: a real 2-rank run, rank 1 frozen (SIGSTOP) after step 1; rank 0 ends with the message."""
    import signal
    import subprocess
    import sys

    import psutil

    from conftest import REPO

    sys.path.insert(0, str(REPO / "tests" / "trainer"))
    from ppo_helpers import read_metrics, small_run_overrides

    run_dir = tmp_path / "run"
    overrides = small_run_overrides(tmp_path, run_dir, **{"trainer.total_steps": 6, "trainer.collective_timeout_s": 20,
                                                           "data.prompts_per_step": 4, "rollout.samples_per_prompt": 2})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "launch/ppo.py",
           "--config", "configs/tiny_cpu.yaml", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    frozen = None
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            deadline = time.monotonic() + 600
            while not ((run_dir / "metrics.jsonl").is_file() and read_metrics(run_dir)) and time.monotonic() < deadline:
                assert proc.poll() is None, proc.stdout.read()[-4000:]
                time.sleep(0.2)
            frozen = next(c for c in psutil.Process(proc.pid).children(recursive=True)
                          if c.environ().get("RANK") == "1" and "launch/ppo.py" in " ".join(c.cmdline()))
            frozen.send_signal(signal.SIGSTOP)
            out, _ = proc.communicate(timeout=600)
        finally:
            if frozen is not None and frozen.is_running():
                frozen.kill()
            if proc.poll() is None:
                proc.kill()
    assert f"exitcode  : {STALL_EXIT_CODE}" in out, out[-4000:]
    assert re.search(r"megarl: rank 0 waited \d+ s in phase '\w+' of step \d \(trainer.collective_timeout_s=20\); "
                     r"(silent \(no heartbeat for 20 s\)|stalled): rank 1 \(last in phase '\w+' of step \d", out), out[-4000:]
