"""megarl.agents.sandbox.run_python: each test is an escape attempt by the sandboxed program, and
shows it fail while the test process (standing in for the trainer) carries on.

The sandbox needs root and namespaces (the CI container has both); where they are missing the
module refuses to run, which test_refuses_without_root checks, and the escape tests skip visibly.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megarl.agents import sandbox
from megarl.agents.sandbox import SandboxLimits, SandboxUnavailable, run_python

REPO = Path(__file__).resolve().parents[2]


def _available() -> str | None:
    try:
        sandbox.check_available()
    except SandboxUnavailable as e:
        return str(e)
    return None


needs_sandbox = pytest.mark.skipif(_available() is not None, reason=f"sandbox unavailable here: {_available()}")


def _sandbox_processes() -> list[int]:
    """Host pids running under a sandbox uid of this process (they must all be gone when run_python
    returns); other processes' sandboxes (a concurrent test run, a trainer's tools) are theirs."""
    first = sandbox._UID_BASE + (os.getpid() % 100_000) * 100  # this process's block (sandbox.run_python)
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                uid = int((entry / "status").read_text().split("\nUid:")[1].split()[0])
            except (OSError, IndexError, ValueError):
                continue
            if first <= uid < first + 100:
                out.append(int(entry.name))
    return out


@needs_sandbox
def test_runs_code_and_reports_output_and_status():
    result = run_python("import sys\nprint(6 * 7)\nprint('oops', file=sys.stderr)\nsys.exit(3)", timeout_s=30)
    assert (result.stdout, result.stderr, result.exit_code, result.timed_out) == ("42\n", "oops\n", 3, False)
    assert not result.output_truncated


@needs_sandbox
def test_cannot_read_files_outside(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("contents-the-sandbox-must-not-see")
    targets = [str(secret), "/etc/shadow", "/etc/passwd", str(REPO / "megarl" / "trainer.py"), str(Path(__file__)),
               f"/proc/{os.getpid()}/environ", "/proc/self/environ", str(REPO / ".venv" / "pyvenv.cfg"), "/work", "/home",
               "/root/.bash_history"]
    code = f"""
import os
for path in {targets!r}:
    try:
        with open(path) as f:
            print("READ", path, f.read(40))
    except IsADirectoryError:
        print("LISTED", path, os.listdir(path))
    except OSError as e:
        print("DENIED", path, type(e).__name__)
print("ROOT", sorted(os.listdir("/")))
"""
    result = run_python(code, timeout_s=30)
    assert result.exit_code == 0, result.stderr
    assert "READ" not in result.stdout and "LISTED" not in result.stdout and "must-not-see" not in result.stdout
    assert result.stdout.count("DENIED") == len(targets)
    # only the interpreter's directories, /dev and /sandbox exist in the new root
    assert "ROOT ['bin', 'dev', 'lib', 'lib64', 'root', 'sandbox', 'sbin', 'usr']" in result.stdout or \
        set(eval(result.stdout.split("ROOT ")[1])) <= {"bin", "dev", "lib", "lib32", "lib64", "root", "opt", "sandbox", "sbin", "usr"}


@needs_sandbox
def test_cannot_see_the_parents_environment(monkeypatch):
    monkeypatch.setenv("MEGARL_TEST_SECRET_TOKEN", "hunter2-do-not-leak")
    code = """
import os
print(sorted(os.environ.items()))
for pid in range(1, 400):
    try:
        print(open(f"/proc/{pid}/environ").read())
    except OSError:
        pass
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    os.makedirs("/sandbox/p", exist_ok=True)
    print("MOUNT", libc.mount(b"proc", b"/sandbox/p", b"proc", 0, None), ctypes.get_errno())
except OSError as e:
    print("MOUNT-ERR", e)
"""
    result = run_python(code, timeout_s=30)
    assert result.exit_code == 0, result.stderr
    assert "hunter2" not in result.stdout and "MEGARL_TEST_SECRET" not in result.stdout
    env = eval(result.stdout.splitlines()[0])
    assert {k for k, _ in env} == {"HOME", "LANG", "LC_ALL", "PATH", "TMPDIR"}
    assert "MOUNT -1 1" in result.stdout  # mount(2) refused: EPERM, the program holds no capability


@needs_sandbox
def test_cannot_open_a_socket_to_a_host_service():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not stop.is_set():
            try:
                accepted.append(server.accept())
            except socket.timeout:
                pass

    stop = threading.Event()
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    code = f"""
import socket
for host in ("127.0.0.1", "localhost", "10.0.0.1", "8.8.8.8"):
    try:
        socket.create_connection((host, {port}), timeout=2)
        print("CONNECTED", host)
    except OSError as e:
        print("REFUSED", host, type(e).__name__)
"""
    try:
        result = run_python(code, timeout_s=30)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert result.exit_code == 0, result.stderr
    assert "CONNECTED" not in result.stdout and result.stdout.count("REFUSED") == 4
    assert accepted == []


@needs_sandbox
def test_cannot_reach_a_host_unix_socket_or_signal_host_processes():
    name = f"\0megarl-sandbox-test-{os.getpid()}"
    server = socket.socket(socket.AF_UNIX)
    server.bind(name)  # abstract namespace: no file to hide, scoped by the network namespace
    server.listen(1)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    code = f"""
import os, signal, socket
s = socket.socket(socket.AF_UNIX)
try:
    s.connect({name!r})
    print("CONNECTED")
except OSError as e:
    print("REFUSED", type(e).__name__)
for pid in ({victim.pid}, {os.getpid()}):
    try:
        os.kill(pid, signal.SIGKILL)
        print("KILLED", pid)
    except OSError as e:
        print("NO-SIGNAL", type(e).__name__)
try:
    os.kill(-1, signal.SIGKILL)  # every process it may signal: none (its namespace's process 1 is exempt)
except ProcessLookupError:
    print("NOBODY")
"""
    try:
        result = run_python(code, timeout_s=30)
        assert victim.poll() is None  # the host process the sandbox tried to kill still runs
    finally:
        victim.kill()
        server.close()
    assert result.stdout.startswith("REFUSED") and "KILLED" not in result.stdout, result
    assert result.stdout.count("NO-SIGNAL") == 2 and result.stdout.endswith("NOBODY\n")


@needs_sandbox
def test_fork_bomb_is_contained():
    limits = SandboxLimits(processes=8)
    code = """
import os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        children += 1
except OSError as e:
    print("FORKS", children, type(e).__name__)
"""
    start = time.monotonic()
    result = run_python(code, timeout_s=20, limits=limits)
    assert result.exit_code == 0 and not result.timed_out, result
    forks = int(result.stdout.split()[1])
    assert forks < limits.processes and "BlockingIOError" in result.stdout
    assert time.monotonic() - start < 15  # the sleeping children did not keep the run alive
    assert _sandbox_processes() == []  # and none survived it


@needs_sandbox
def test_cannot_fill_the_disk():
    limits = SandboxLimits(file_bytes=2 * 2**20, disk_bytes=4 * 2**20)
    code = """
import os
def fill(path, chunks):
    written = 0
    try:
        with open(path, "wb") as f:
            for _ in range(chunks):
                f.write(b"x" * 2**20)
                f.flush()
                written += 1
        return f"{path} ok {written}"
    except OSError as e:
        return f"{path} {type(e).__name__} {e.errno} after {written}"
print(fill("/sandbox/one", 100))               # RLIMIT_FSIZE: 2 MiB per file
for i in range(4):
    print(fill(f"/sandbox/many{i}", 1))        # the tmpfs: 4 MiB in all
for path in ("/big", "/usr/big", "/dev/big", "/tmp/big", "/root/big"):
    print(fill(path, 1))                       # nothing else is writable
"""
    result = run_python(code, timeout_s=30, limits=limits)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "/sandbox/one OSError 27 after 2"  # EFBIG at the 2 MiB file limit
    assert any(" 28 " in line for line in lines[1:5]), lines  # ENOSPC once the 4 MiB tmpfs is full
    assert all(" ok " not in line for line in lines[5:]), lines


@needs_sandbox
def test_memory_is_limited():
    code = """
try:
    block = bytearray(2 * 2**30)
    print("ALLOCATED")
except MemoryError:
    print("MemoryError")
"""
    result = run_python(code, timeout_s=30, limits=SandboxLimits(memory_bytes=256 * 2**20))
    assert result.stdout == "MemoryError\n" and result.exit_code == 0


@needs_sandbox
def test_cpu_time_is_limited():
    result = run_python("while True:\n    pass", timeout_s=60, limits=SandboxLimits(cpu_s=1))
    assert result.exit_code == 128 + 24 and not result.timed_out  # SIGXCPU at the 1 s CPU limit


@needs_sandbox
def test_sleeping_forever_costs_one_timeout():
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(10**6)\ntime.sleep(10**6)"
    start = time.monotonic()
    result = run_python(code, timeout_s=1.5)
    elapsed = time.monotonic() - start
    assert result.timed_out and result.exit_code == -9
    assert elapsed < 6
    assert _sandbox_processes() == []  # the detached child went with the namespace


@needs_sandbox
def test_printing_gigabytes_is_cut_off():
    limits = SandboxLimits(output_bytes=100_000)
    start = time.monotonic()
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", timeout_s=60, limits=limits)
    assert result.output_truncated and not result.timed_out
    assert result.stdout == "x" * 100_000
    assert time.monotonic() - start < 20  # killed at the cap, not at the timeout


def test_refuses_without_root(monkeypatch):
    """Where a protection is missing the sandbox refuses, naming it, instead of running weaker."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    sandbox._availability.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match=r"needs root .* uid 1000"):
            run_python("print(1)")
    finally:
        monkeypatch.undo()
        sandbox._availability.cache_clear()


def test_refuses_without_unshare(monkeypatch):
    real_which = sandbox.shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None if name == "unshare" else real_which(name))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    sandbox._availability.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match=r"the unshare command \(util-linux\) is not on PATH"):
            run_python("print(1)")
    finally:
        monkeypatch.undo()
        sandbox._availability.cache_clear()


def test_package_import_stays_light():
    """megarl.agents imports no torch (an environment may run without it)."""
    probe = "import sys, megarl.agents; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    assert out.stdout.strip() == "False"


def test_result_as_an_observation():
    from megarl.agents.sandbox import SandboxResult

    assert SandboxResult("45\n", "", 0, False).observation() == "45\n"
    assert SandboxResult("", "Traceback ...\nZeroDivisionError: division by zero\n", 1, False).observation(40) == \
        "ZeroDivisionError: division by zero\n[exit code 1]\n"[-40:]
    assert SandboxResult("partial", "", -9, True).observation() == "partial\n[timed out]\n"
    assert SandboxResult("x" * 10, "", -9, False, True).observation() == "x" * 10 + "\n[output truncated]\n[exit code -9]\n"
