"""A Python code tool that keeps model-written code in: `run_python(code, timeout_s=...)`.

The code runs in its own process tree inside fresh Linux namespaces, made with `unshare`
(util-linux) and no service:

| threat | what stops it |
|---|---|
| reading host files (the repository, /etc/shadow, the run directory, other tmp files) | mount namespace + chroot into a new root holding only the interpreter's directories (read-only, nosuid, nodev), four /dev nodes and /sandbox |
| writing anywhere but /sandbox; filling the disk | the root is read-only; /sandbox is a tmpfs of `disk_bytes` (and 1024 inodes); RLIMIT_FSIZE caps each file at `file_bytes` |
| the trainer's environment (tokens, credentials, paths) | a clean environment (PATH, HOME, TMPDIR, LANG only); no /proc is mounted, and the pid namespace would hide the trainer's processes anyway |
| network (including the host's loopback services) | a new network namespace: only its own loopback, which is down |
| signalling or tracing host processes | pid namespace; a private, unprivileged uid (no groups, no capabilities, no_new_privs) |
| fork bombs | RLIMIT_NPROC under a uid no other process uses (`processes`) |
| memory | RLIMIT_AS per process (`memory_bytes`) |
| CPU burn, sleeping forever | RLIMIT_CPU (`cpu_s`) and the wall-clock `timeout_s`, after which the whole pid namespace is killed |
| printing gigabytes | each stream is read up to `output_bytes`; past that the sandbox is killed and `output_truncated` is set |

What it does not do (say so where it matters): no seccomp filter (the kernel's whole system-call
surface stays reachable to an unprivileged process), no cgroup (memory is bounded per process by
RLIMIT_AS, so in total by about processes x memory_bytes plus the tmpfs), and the interpreter's
own files (its standard library and site-packages) are readable. It needs root (uid 0, as in the
trainer's containers) for the namespaces and the uid switch: elsewhere `SandboxUnavailable` is
raised, naming what is missing, and nothing runs unprotected.

The program sees: `python` (this interpreter's base installation, not the trainer's virtual
environment), the standard library, cwd = HOME = TMPDIR = /sandbox, empty stdin.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

_INIT = Path(__file__).with_name("sandbox_init.py")
_UID_BASE = 1_500_000  # far above any uid a host hands out; one uid per concurrent sandbox (RLIMIT_NPROC counts per uid)
_uid_slots = itertools.count()
_uid_lock = threading.Lock()


class SandboxUnavailable(RuntimeError):
    """This host cannot build the sandbox; the message says which mechanism is missing."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits; every byte count is per sandbox run."""

    cpu_s: int = 10  # RLIMIT_CPU of each process
    memory_bytes: int = 512 * 2**20  # RLIMIT_AS of each process
    processes: int = 16  # RLIMIT_NPROC of the sandbox's uid
    open_files: int = 64  # RLIMIT_NOFILE
    file_bytes: int = 8 * 2**20  # RLIMIT_FSIZE: largest file it can write
    disk_bytes: int = 16 * 2**20  # size of the /sandbox tmpfs
    output_bytes: int = 64 * 2**10  # kept of stdout and of stderr each; more ends the run
    max_code_bytes: int = 1 * 2**20


@dataclass(frozen=True)
class SandboxResult:
    """stdout / stderr (UTF-8, undecodable bytes replaced, each cut at output_bytes); exit_code: the
    program's status (128 + signal when a signal ended it, e.g. 137 for SIGKILL, 152 for SIGXCPU;
    125 when the sandbox itself could not be set up; -9 when the wall clock or the output cap
    killed it); timed_out: the wall-clock timeout killed it; output_truncated: the output cap did."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    output_truncated: bool = False

    def observation(self, max_chars: int = 2000) -> str:
        """The text an environment shows the policy: stdout, stderr, then a note when the program
        did not end normally; cut to the last max_chars (tracebacks end with the error)."""
        notes = (["[timed out]"] if self.timed_out else []) + (["[output truncated]"] if self.output_truncated else []) \
            + ([f"[exit code {self.exit_code}]"] if self.exit_code != 0 and not self.timed_out else [])
        text = self.stdout + self.stderr
        if notes and text and not text.endswith("\n"):
            text += "\n"
        text += "".join(f"{note}\n" for note in notes)
        return text[-max_chars:]


def run_python(code: str, timeout_s: float = 10.0, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` with the interpreter's base Python inside the sandbox; at most timeout_s of wall time."""
    check_available()
    with _uid_lock:
        uid = _UID_BASE + (os.getpid() % 100_000) * 100 + next(_uid_slots) % 100
    params = {"uid": uid, "python": _python(), "binds": _binds(), "links": _links(), "max_code_bytes": limits.max_code_bytes,
              "limits": {k: v for k, v in asdict(limits).items() if k not in ("output_bytes", "max_code_bytes")}}
    cmd = [shutil.which("unshare"), "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
           _python(), "-I", "-S", "-c", _INIT.read_text(), json.dumps(params)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
                            env={"PATH": "/usr/bin:/bin"}, start_new_session=True, close_fds=True)
    over_cap = threading.Event()
    outs = [_CappedReader(proc.stdout, limits.output_bytes, over_cap), _CappedReader(proc.stderr, limits.output_bytes, over_cap)]
    try:
        proc.stdin.write(code.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass  # setup failed before reading; its stderr says why
    deadline = time.monotonic() + timeout_s
    timed_out = False
    while proc.poll() is None:
        if over_cap.is_set():
            _kill(proc)
            break
        if time.monotonic() > deadline:
            timed_out = True
            _kill(proc)
            break
        over_cap.wait(0.02)
    proc.wait()
    _wait_until_gone(uid)
    for out in outs:
        out.join()
    return SandboxResult(stdout=outs[0].text(), stderr=outs[1].text(), exit_code=proc.returncode, timed_out=timed_out,
                         output_truncated=any(o.truncated for o in outs))


def _kill(proc: subprocess.Popen) -> None:
    # unshare and the namespace's process 1 share the new session's process group; process 1 also
    # dies with unshare (--kill-child), and the kernel then kills every process of the namespace.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _uid_alive(uid: int) -> bool:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status") as f:
                    if f"\nUid:\t{uid}\t" in f.read():
                        return True
            except OSError:
                continue
    return False


def _wait_until_gone(uid: int, timeout_s: float = 5.0) -> None:
    # unshare exits before the kernel has finished killing the namespace's other processes (a
    # child that called setsid left the killed process group): they are gone a moment later. Wait
    # for that, so that a call returns with nothing of its sandbox left on the host.
    deadline = time.monotonic() + timeout_s
    while _uid_alive(uid) and time.monotonic() < deadline:
        time.sleep(0.01)


class _CappedReader:
    """Reads a pipe on a thread, keeping the first `cap` bytes; sets `over_cap` past them."""

    def __init__(self, pipe, cap: int, over_cap: threading.Event):
        self.pipe, self.cap, self.over_cap = pipe, cap, over_cap
        self.kept, self.truncated = bytearray(), False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while chunk := self.pipe.read1(65536):
            room = self.cap - len(self.kept)
            self.kept += chunk[:max(room, 0)]
            if len(chunk) > room:
                self.truncated = True
                self.over_cap.set()
                break
        self.pipe.close()

    def join(self) -> None:
        self.thread.join()

    def text(self) -> str:
        return self.kept.decode("utf-8", errors="replace")


def _python() -> str:
    """The base interpreter (not a virtual environment's, whose site-packages would sit in the repo)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _binds() -> list[str]:
    """Directories bound read-only into the new root: /usr, the real /lib and /lib64 when they are
    not links into /usr, and the interpreter's installation when it lives elsewhere."""
    binds = ["/usr"] + [d for d in ("/lib", "/lib64", "/lib32") if os.path.isdir(d) and not os.path.islink(d)]
    prefix = os.path.realpath(sys.base_prefix)
    if not any(prefix == b or prefix.startswith(b + "/") for b in binds):
        binds.append(prefix)
    return binds


def _links() -> dict[str, str]:
    """Top-level links of a merged-/usr system (/bin -> usr/bin ...), recreated in the new root."""
    return {d: os.readlink(d) for d in ("/bin", "/sbin", "/lib", "/lib64", "/lib32") if os.path.islink(d)}


@functools.lru_cache(maxsize=1)
def _availability() -> str | None:
    """Why the sandbox cannot run here, or None (probed once per process)."""
    if sys.platform != "linux":
        return f"it needs Linux namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return (f"it needs root (uid 0) to create mount/pid/net namespaces and switch to a private uid; this process runs "
                f"as uid {os.geteuid()}")
    if shutil.which("unshare") is None:
        return "the unshare command (util-linux) is not on PATH: install util-linux"
    # the exact flags run_python uses (--kill-child needs util-linux >= 2.32; busybox's unshare lacks it)
    flags = ["--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child"]
    probe = subprocess.run([shutil.which("unshare"), *flags, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return (f"`unshare {' '.join(flags)}` failed ({probe.stderr.strip() or probe.returncode}): the container must "
                f"allow creating namespaces (e.g. docker --privileged or CAP_SYS_ADMIN) and unshare must be util-linux's")
    return None


def check_available() -> None:
    """Raise SandboxUnavailable naming the missing mechanism; nothing runs without every protection."""
    reason = _availability()
    if reason is not None:
        raise SandboxUnavailable(f"megarl.agents.sandbox cannot run code safely: {reason}")
    if not _INIT.is_file():
        raise SandboxUnavailable(f"megarl.agents.sandbox: {_INIT} is missing from the installation")
