"""Nothing lost (issue 11, items 4 and 5): a run directory has one live run at a time (a lock that
names the holder and that a kill -9 frees), a save killed between its two renames loses nothing,
and resuming from an older checkpoint moves the abandoned trajectory's newer ones aside."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

import megarl.checkpointing.checkpoint_io as cio
from megarl.checkpointing.checkpoint_io import (RunDirLock, RunDirLocked, abandon_newer, atomic_dir, latest_complete_checkpoint,
                                  remove_leftovers, step_dir)

HOLD = textwrap.dedent("""
    import sys, time
    from megarl.checkpointing.checkpoint_io import RunDirLock
    RunDirLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(120)
""")


def _holder(run_dir):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_is_refused_naming_the_first_and_a_killed_holder_frees_the_lock(tmp_path):
    first = _holder(tmp_path)
    try:
        with pytest.raises(RunDirLocked) as info:
            RunDirLock(tmp_path).acquire()
        message = str(info.value)
        assert f"host {socket.gethostname()} pid {first.pid}" in message and "another trainer.run_dir" in message
    finally:
        first.send_signal(signal.SIGKILL)  # what kill -9 leaves: the lock file, no live holder
        first.wait()
    assert (tmp_path / ".lock").exists()
    with RunDirLock(tmp_path) as lock:  # the stale lock is recognised: it is free
        assert lock.holder()["pid"] == os.getpid()
        with pytest.raises(RunDirLocked):
            RunDirLock(tmp_path).acquire()
    RunDirLock(tmp_path).acquire().release()  # released on exit


def _save(run_dir, step, payload):
    with atomic_dir(step_dir(run_dir, step)) as tmp:
        (tmp / "model.bin").write_text(payload)


def test_a_kill_between_the_two_renames_of_an_overwrite_loses_nothing(tmp_path, monkeypatch):
    _save(tmp_path, 10, "v1")

    def killed():
        raise SystemExit("SIGKILL")  # the process dies here; nothing after it runs

    monkeypatch.setattr(cio, "_between_renames", killed)
    with pytest.raises(SystemExit):
        _save(tmp_path, 10, "v2")
    monkeypatch.undo()
    assert not step_dir(tmp_path, 10).exists()  # the window the issue describes
    remove_leftovers(tmp_path)  # the next start
    assert latest_complete_checkpoint(tmp_path) == step_dir(tmp_path, 10)
    assert (step_dir(tmp_path, 10) / "model.bin").read_text() == "v2"
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000010"]


def test_resuming_from_an_older_checkpoint_moves_the_newer_ones_aside(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path, step, f"s{step}")
    (tmp_path / "step_00000040").mkdir()  # incomplete, also from the abandoned trajectory
    moved = abandon_newer(tmp_path, 10)
    assert sorted(p.name for p in moved) == ["step_00000020", "step_00000030", "step_00000040"]
    assert latest_complete_checkpoint(tmp_path) == step_dir(tmp_path, 10)  # what resume=auto will pick
    assert all((p / "model.bin").read_text() == f"s{p.name[-2:]}" for p in moved if p.name != "step_00000040")
    assert abandon_newer(tmp_path, 10) == []
