"""Persistent test worlds (issue 37): worlds of 1, 2 and 4 ranks started once per pytest session,
each running many jobs, instead of a torchrun (imports, process-group start-up) per test.

    from worlds import world
    proc = world(2).ppo(argv, timeout=900)        # launch/ppo.py's main(argv) on every rank, inside
                                                  # the world's process group: a CompletedProcess as
                                                  # torchrun's (stdout / stderr of every rank, code)
    values = world(2).call("mod:fn", *args)       # fn(*args) on every rank -> [rank 0's value, ...]

As Megatron-Core's own unit tests do, the process group is made once per world and Megatron's model
parallel groups are rebuilt per job (`Run` opens and closes inside an existing group: megarl/run.py).
A job that fails (any rank's exit code not 0) or hangs past its timeout ends its world: every rank is
killed and the next job starts a fresh one, so one failure cannot poison the next test. A rank that
does not answer within the timeout is named in the failure.

MEGARL_TEST_WORLDS=0 turns the worlds off: every job then runs as its own torchrun, as before.
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Listener, wait
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_WORLDS: dict[int, "World"] = {}
# A rank after a PPO job holds ~60 threads; each run a job leaves alive adds ~50 (its gloo groups)
MAX_RANK_THREADS = 200


def enabled() -> bool:
    return os.environ.get("MEGARL_TEST_WORLDS", "1") != "0"


class WorldFailed(RuntimeError):
    """A rank died, hung or failed to start; the message names it and holds its output's tail."""


class World:
    def __init__(self, nproc: int):
        self.nproc = nproc
        self.procs: list[subprocess.Popen] = []
        self.conns: list = []
        self.logs: list[Path] = []
        self.jobs = 0
        self._dir = Path(tempfile.mkdtemp(prefix=f"megarl-world{nproc}-"))

    # --- life --------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def start(self, timeout: float = 300) -> None:
        from conftest import free_port

        key = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WORLD_SIZE=str(self.nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), LOCAL_WORLD_SIZE=str(self.nproc),
                   MEGARL_WORLD_DRIVER=f"127.0.0.1:{listener.address[1]}", MEGARL_WORLD_KEY=key.hex())
        self.logs = [self._dir / f"rank{rank}.log" for rank in range(self.nproc)]
        for rank in range(self.nproc):
            with open(self.logs[rank], "w") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(REPO / "tests" / "world_rank.py")], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                    env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), start_new_session=True))
        accepted: dict[int, object] = {}

        def accept():
            while len(accepted) < self.nproc:
                conn = listener.accept()
                accepted[conn.recv()] = conn

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        deadline = time.time() + timeout
        while thread.is_alive() and time.time() < deadline and all(p.poll() is None for p in self.procs):
            thread.join(0.2)
        listener.close()
        if len(accepted) < self.nproc:
            self.stop()
            raise WorldFailed(f"a world of {self.nproc} did not start:\n{self._log_tails()}")
        self.conns = [accepted[rank] for rank in range(self.nproc)]
        for rank, conn in enumerate(self.conns):  # every rank joined the process group
            if not conn.poll(timeout) or conn.recv() != "ready":
                self.stop()
                raise WorldFailed(f"rank {rank} of a world of {self.nproc} did not join its process group:\n{self._log_tails()}")

    def stop(self) -> None:
        """Every rank ended: politely when idle, killed (its whole process session) otherwise."""
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.time() + 10
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
                proc.wait()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def threads(self) -> list[int]:
        """Each rank's thread count (Linux: /proc); [] where it cannot be read."""
        try:
            return [len(os.listdir(f"/proc/{proc.pid}/task")) for proc in self.procs]
        except OSError:
            return []

    def _overgrown(self) -> bool:
        """Whether a rank holds more threads than a fresh rank after any job of the suite (about 60): what
        a job left alive (a model Megatron or a library keeps referenced, its process groups with it)
        costs every later job, since each idle gloo TCP loop wakes every 10 ms. Such a world is restarted
        before the next job (seconds) instead of slowing the rest of the session."""
        return any(n > MAX_RANK_THREADS for n in self.threads())

    def _log_tails(self, chars: int = 3000) -> str:
        return "\n".join(f"--- rank {rank} ---\n{log.read_text()[-chars:]}" for rank, log in enumerate(self.logs) if log.exists())

    # --- jobs --------------------------------------------------------------------------------------
    def _submit(self, job: dict, timeout: float) -> tuple[list[dict | None], list[str], list[str]]:
        """Send `job` to every rank; (answers, stdouts, stderrs); an answer is None for a rank that died
        or hung (the world is then stopped)."""
        if not self.alive:
            self.stop()
            self.start()
        self.jobs += 1
        outs = [self._dir / f"job{self.jobs}.rank{r}.out" for r in range(self.nproc)]
        errs = [self._dir / f"job{self.jobs}.rank{r}.err" for r in range(self.nproc)]
        from conftest import free_port

        port = str(free_port())  # for a rank that must make the default group again (tests/world_rank.py)
        for rank, conn in enumerate(self.conns):
            conn.send(dict(job, stdout=str(outs[rank]), stderr=str(errs[rank]), port=port))
        answers: list[dict | None] = [None] * self.nproc
        pending = dict(enumerate(self.conns))
        deadline, failed_at = time.time() + timeout, None
        while pending and time.time() < deadline:
            # torchrun stops the others soon after one rank fails: they may wait on it forever
            if failed_at is not None and time.time() > failed_at + 20:
                break
            for conn in wait(list(pending.values()), timeout=1.0):
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    answers[rank] = conn.recv()
                except (EOFError, OSError):
                    answers[rank] = None
                del pending[rank]
                if answers[rank] is None or answers[rank]["code"] != 0:
                    failed_at = failed_at or time.time()
            if any(self.procs[r].poll() is not None for r in pending):
                failed_at = failed_at or time.time()
        if pending or not all(a is not None and a["reusable"] for a in answers) or self._overgrown():
            self.stop()
        read = [p.read_text() if p.exists() else "" for p in outs], [p.read_text() if p.exists() else "" for p in errs]
        for path in outs + errs:
            path.unlink(missing_ok=True)
        if pending and time.time() >= deadline:
            read[1][min(pending)] += f"\n[tests/worlds.py] rank {min(pending)} did not finish within {timeout:.0f} s: world stopped\n"
        return answers, read[0], read[1]

    def _completed(self, job: dict, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        """The job as torchrun would have ended it: 0 when every rank exits 0, else 1 (a world of one:
        its own code, as a plain `python` run), with every rank's stdout and stderr, rank 0 first."""
        answers, outs, errs = self._submit(job, timeout)
        codes = [a["code"] if a is not None else -9 for a in answers]
        code = 0 if all(c == 0 for c in codes) else (codes[0] if self.nproc == 1 else 1)
        return subprocess.CompletedProcess(["<world>", *argv], code, "".join(outs), "".join(errs))

    def ppo(self, argv: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
        """launch/ppo.py main(argv) on every rank, Run opened and closed inside the world's group."""
        return self._completed({"kind": "ppo", "argv": argv}, ["launch/ppo.py", *argv], timeout)

    def script(self, argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
        """`torchrun --nproc_per_node N <argv>` as a job: argv is a script path (from the repository root)
        or ["-m", module, ...], run as __main__ on every rank."""
        return self._completed({"kind": "script", "argv": argv}, argv, timeout)

    def call(self, target: str, *args, timeout: float = 600, **kwargs) -> list:
        """target ("module:function") called on every rank; the ranks' return values, rank 0 first."""
        answers, outs, errs = self._submit({"kind": "call", "target": target, "args": list(args), "kwargs": kwargs}, timeout)
        if not all(a is not None and a["code"] == 0 for a in answers):
            tail = "".join(f"--- rank {r} ---\n{o[-2000:]}{e[-4000:]}" for r, (o, e) in enumerate(zip(outs, errs)))
            raise WorldFailed(f"{target} failed in a world of {self.nproc}:\n{tail}")
        return [a["result"] for a in answers]


def fits(nproc: int, args: list[str], env: dict | None) -> bool:
    """Whether `torchrun(nproc, args, env)` can be a world's job: worlds on, no environment of its own
    (variables read at import time would not reach a started rank), a world size kept here, and a
    launch/ppo.py run only when colocated (separate placement splits the world's default group; vLLM
    patches torch.distributed process-wide)."""
    if not enabled() or env is not None or nproc not in (0, 1, 2, 4) or not args:
        return False
    if args[0] == "launch/ppo.py":
        return not any(a.startswith(("rollout.placement=separate", "rollout.engine=vllm")) for a in args)
    return args[0] == "-m" or args[0].endswith(".py")


def world(nproc: int) -> World:
    """The session's world of nproc ranks, started on first use (and again after a failed job)."""
    if nproc not in _WORLDS:
        _WORLDS[nproc] = World(nproc)
    return _WORLDS[nproc]


def stop_all() -> None:
    import shutil

    for w in _WORLDS.values():
        w.stop()
        shutil.rmtree(w._dir, ignore_errors=True)
    _WORLDS.clear()
