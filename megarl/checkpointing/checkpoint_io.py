"""Atomic checkpoint directories: a checkpoint is either complete or invisible.

A checkpoint is written into `<final>.tmp-<token>` and renamed to `<final>` only after every
writer finished; a `COMPLETE` marker inside records that. A crash mid-write leaves a temp
directory that no reader considers, and never touches an older good checkpoint.

Several ranks write into one checkpoint (Megatron dist_checkpointing), so the protocol takes a
`barrier` callable instead of importing torch.distributed:

    rank 0: remove a leftover temp dir, create it         | barrier
    all   : write their shards                            | barrier
    rank 0: write COMPLETE, rename into place             | barrier
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from contextlib import contextmanager
import fcntl
from pathlib import Path
import socket
from typing import Callable, Iterator

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_LEFTOVER = re.compile(r"^step_\d{8}\.(tmp|old)-")


def step_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """<run_dir>/step_00000042."""
    return Path(run_dir) / f"step_{step:08d}"


def checkpoint_step(path: str | os.PathLike) -> int:
    """42 for .../step_00000042."""
    m = _STEP_DIR.match(Path(path).name)
    if not m:
        raise ValueError(f"{path} is not a checkpoint directory named step_XXXXXXXX")
    return int(m.group(1))


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / COMPLETE).is_file()


def complete_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete step_XXXXXXXX directories of a run, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if _STEP_DIR.match(p.name) and p.is_dir() and is_complete(p)]
    return sorted(found, key=checkpoint_step)


def latest_complete_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


@contextmanager
def atomic_dir(final_path: str | os.PathLike, *, rank: int = 0, barrier: Callable[[], None] | None = None,
               token: str | None = None) -> Iterator[Path]:
    """Yield a temp dir to write into; on success it becomes `final_path` (with a COMPLETE marker).

    Single process: leave `barrier` None. Several ranks: every rank calls this with the same
    `final_path`, the same `token` (default "shared") and a barrier over all writers. On an
    exception in the body, rank 0 removes the temp dir; the exception propagates.
    """
    final = Path(final_path)
    if barrier is None:
        token = token or secrets.token_hex(4)
    tmp = final.with_name(f"{final.name}.tmp-{token or 'shared'}")
    sync = barrier or (lambda: None)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crashed attempt with this token
        tmp.mkdir(parents=True)
    sync()
    try:
        yield tmp
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    sync()  # every rank has finished writing
    if rank == 0:
        (tmp / COMPLETE).write_text(json.dumps({"time": time.time()}) + "\n")
        _replace_dir(tmp, final)
    sync()  # nobody reads or cleans up before the checkpoint is in place


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename tmp to final; an existing final is moved aside first and removed last.

    Between the two renames no `final` exists; a kill there leaves the complete new checkpoint as
    `<final>.tmp-*` and the old one as `<final>.old-*`, and `remove_leftovers` puts the new one in
    place at the next start instead of deleting it (tested by killing at that point).
    """
    if not final.exists():
        os.rename(tmp, final)
        return
    old = final.with_name(f"{final.name}.old-{secrets.token_hex(4)}")
    os.rename(final, old)
    _between_renames()
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _between_renames() -> None:
    """A seam for the test that kills a save between its two renames."""


def cleanup_old_checkpoints(run_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep_last` (0 = keep all); rank 0 only."""
    if keep_last <= 0:
        return []
    doomed = complete_checkpoints(run_dir)[:-keep_last]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def remove_leftovers(run_dir: str | os.PathLike) -> list[Path]:
    """Clean up after interrupted saves; rank 0 at start-up, before any save. Returns what it deleted.

    A save killed between its two renames (`_replace_dir`) left no `step_X` but a complete
    `step_X.tmp-*` (the new checkpoint) and `step_X.old-*` (the one it replaced): the complete
    one, preferring the new, is renamed back to `step_X` first. Everything else is deleted.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    leftovers = sorted((p for p in run_dir.iterdir() if _LEFTOVER.match(p.name) and p.is_dir()),
                       key=lambda p: (".old-" in p.name, p.name))  # new (tmp) before old
    for path in leftovers:
        final = run_dir / path.name.split(".", 1)[0]
        if not final.exists() and is_complete(path):
            os.rename(path, final)
    leftovers = [p for p in leftovers if p.exists()]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


def abandon_newer(run_dir: str | os.PathLike, step: int) -> list[Path]:
    """Move checkpoints newer than `step` into `<run_dir>/abandoned/<time>/`; rank 0 only.

    Resuming from an explicit older checkpoint starts a new trajectory: the newer checkpoints of
    the old one must not be picked up by a later resume=auto, and are kept (moved, not deleted)
    in case they are wanted back. Returns their new paths.
    """
    run_dir = Path(run_dir)
    newer = [p for p in complete_checkpoints(run_dir) if checkpoint_step(p) > step]
    newer += [p for p in run_dir.iterdir() if _STEP_DIR.match(p.name) and p.is_dir() and not is_complete(p)
              and checkpoint_step(p) > step] if run_dir.is_dir() else []
    if not newer:
        return []
    dest = run_dir / "abandoned" / time.strftime("%Y%m%d-%H%M%S")
    dest.mkdir(parents=True, exist_ok=True)
    moved = []
    for path in newer:
        os.rename(path, dest / path.name)
        moved.append(dest / path.name)
    return moved


class RunDirLocked(RuntimeError):
    """Another live run holds the run directory."""


class RunDirLock:
    """An exclusive lock on a run directory, held for the life of the run (rank 0 takes it).

    `<run_dir>/.lock` is held with flock and records {host, pid, started}. The kernel drops a
    flock when its process dies, kill -9 included, so a lock left by a killed run is recognised
    as stale by simply being free; no pid guessing. A second run on the same directory gets a
    RunDirLocked naming the first run's host and pid. (flock also works across hosts on NFSv4 and
    Lustre; on a filesystem without locks, use a run_dir per run.)
    """

    FILE = ".lock"

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / self.FILE
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = self.holder()
            os.close(fd)
            who = (f"host {holder.get('host', '?')} pid {holder.get('pid', '?')}, started "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['started']))}" if "started" in holder
                   else "another process")
            raise RunDirLocked(f"trainer.run_dir {self.path.parent} is in use by a running megarl job ({who}); "
                               f"wait for it to finish, stop it, or give this run another trainer.run_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}) + "\n").encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def holder(self) -> dict:
        """What the lock file says about its holder ({} if unreadable)."""
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (its content is history)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
