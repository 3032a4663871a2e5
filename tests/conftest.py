"""Shared fixtures: tiny models of every family (built locally, never downloaded), the one way to
run a multi-process test, and the tiers.

Multi-process tests (marker `multiprocess`) start their ranks with one of two helpers here:
    torchrun(nproc, ["tests/x/worker.py", ...])   a worker script under torchrun, as users launch
    spawn(fn, nproc, *args)                        fn(rank, port, *args) in forked processes
and any single-process gloo world takes its port from free_port().

Tiers (pytest.ini): `make test-fast` deselects slow, multiprocess, gpu and vllm; `gpu` tests skip,
visibly, without CUDA and `vllm` tests without the vllm package.
"""
from __future__ import annotations

import importlib.util
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.models.families import DENSE_FAMILIES, LARGE_MOE_FAMILIES, MOE_FAMILIES

REPO = Path(__file__).resolve().parents[1]
# Test support that is not part of the package (the synthetic sharded model, the naive all-gather
# baseline) lives beside the benchmarks that use it.
sys.path.insert(0, str(REPO / "benchmarks"))
# The families come from megarl's one list (megarl.models.families). The 671B-class families (issue 14)
# have their own, variant-rich fixture (`tiny_moe_671b_models`): adding them to FAMILIES would run
# every family-wide test on two more, slower models.
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
FAMILIES_671B = LARGE_MOE_FAMILIES

# Keep every test process single-threaded: the suite runs many ranks on two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# W&B's process-wide settings decide its analytics, not wandb.init(mode="offline"): without this, the
# in-process logger tests leave OpenTelemetry exporter threads in the pytest process, and a later
# fork (conftest.spawn) can crash in OpenTelemetry's after-fork handler (a SIGSEGV seen in CI).
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the vllm marker is added here
def pytest_collection_modifyitems(config, items):
    """Skip, visibly, the tiers this machine cannot run."""
    import torch

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    no_vllm = pytest.mark.skip(reason="needs vllm (make test-vllm sets up its environment)")
    # A namespace package is not vllm: tests/ is on sys.path, so the directory tests/vllm is found as "vllm".
    spec = importlib.util.find_spec("vllm")
    has_vllm = spec is not None and spec.origin not in (None, "namespace")
    _run_first(items, os.environ.get("MEGARL_TEST_FIRST", ""), os.environ.get("MEGARL_TEST_LAST", ""))
    for item in items:
        if "tests/vllm/" in Path(str(item.fspath)).as_posix():
            item.add_marker(pytest.mark.vllm)  # the real-vLLM tier is one directory: `-m vllm` selects it
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(no_vllm)


def _run_first(items: list, prefixes: str, last: str = "") -> None:
    """MEGARL_TEST_FIRST=tests/multinode,...: the tests under these paths (directories or files) first, each group in its
    collected order. `make test` puts the tests that mostly wait (namespaces' rendezvous, Slurm
    requeues, heartbeat timeouts) first, while the other environments are built beside them at low
    priority: the builds take the cores those tests leave idle instead of slowing the CPU-bound ones.
    MEGARL_TEST_LAST (the same form): these at the end, once the builds are done (the benchmark gate's
    tests read wall-time ratios: beside the builds a 25% injected stall read 1.10x, inconclusive), and
    under `make test` once the tiers beside the full suite have ended (wait_before_the_last_tests)."""
    wanted, at_end = _test_paths(prefixes), _test_paths(last)
    if not wanted and not at_end:
        return

    def rank(item) -> int:
        path = _repo_path(item)
        if _under(path, at_end):
            return len(wanted) + 1
        return next((i for i, p in enumerate(wanted) if _under(path, [p])), len(wanted))

    items[:] = sorted(items, key=rank)  # stable: the collected order within each group


def _test_paths(value: str) -> list[str]:
    """MEGARL_TEST_FIRST / MEGARL_TEST_LAST's comma-separated paths."""
    return [p.strip().rstrip("/") for p in value.split(",") if p.strip()]


def _repo_path(item) -> str:
    return Path(str(item.fspath)).resolve().relative_to(REPO).as_posix()


def _under(path: str, paths: list[str]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in paths)


# `make test` runs the core and vLLM tiers in the background (its tiers-beside), niced, in the cores the
# full suite leaves idle; MEGARL_TEST_LAST_WAITS_FOR=<pid> names that background. The MEGARL_TEST_LAST
# tests (the benchmark gate's, which read wall-time ratios) start only once it has ended, on a quiet
# machine: the wait costs the suite little, since the background then has the cores to itself and would
# have run after the full suite otherwise.
_WAITED_FOR_BESIDE: list[float] = []
WAIT_FOR_BESIDE_AT_MOST_S = 3600.0


def process_running(pid: int) -> bool:
    """Whether `pid` is alive (a zombie, which its parent has not reaped yet, has ended)."""
    import psutil

    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def wait_before_the_last_tests(item, say=print, poll_s: float = 2.0) -> float:
    """Before the first MEGARL_TEST_LAST test: wait for MEGARL_TEST_LAST_WAITS_FOR's process to end
    (at most WAIT_FOR_BESIDE_AT_MOST_S). Returns the seconds waited (0 when there was nothing to wait for)."""
    import time

    pid = os.environ.get("MEGARL_TEST_LAST_WAITS_FOR", "")
    if _WAITED_FOR_BESIDE or not pid.isdigit() or not _under(_repo_path(item), _test_paths(os.environ.get("MEGARL_TEST_LAST", ""))):
        return 0.0
    start = time.monotonic()
    if process_running(int(pid)):
        say(f"[conftest] waiting for the tiers beside the full suite (pid {pid}) to end before {item.nodeid} "
            "and the other tests that read wall-time ratios")
        while process_running(int(pid)) and time.monotonic() - start < WAIT_FOR_BESIDE_AT_MOST_S:
            time.sleep(poll_s)
        state = "ended" if not process_running(int(pid)) else f"still running after {WAIT_FOR_BESIDE_AT_MOST_S:.0f} s: going on"
        say(f"[conftest] the tiers beside {state} ({time.monotonic() - start:.0f} s waited)")
    _WAITED_FOR_BESIDE.append(time.monotonic() - start)
    return _WAITED_FOR_BESIDE[0]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's rendezvous or a server a test starts,
    chosen below the kernel's ephemeral range: the OS hands ports of that range to every outgoing
    connection and every bind to port 0, and with the core and vLLM tiers running beside the full
    one, a port of it picked here was taken by another process before the test's server bound it
    (tests/tracking/test_monitor_run.py: "Address already in use", CI at 9bbb32f). Below the range,
    only another test picking at random could take it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.SystemRandom()
    for _ in range(100):
        port = pick.randrange(10000, max(low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range below is crowded: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_output(path: Path, text: str, proc: subprocess.Popen, timeout_s: float = 240.0) -> None:
    """Until `text` appears in the file `path` (a process's output); fails, with the file's tail, if
    `proc` ends first or timeout_s pass."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[:4]} exited {proc.returncode} before {text!r}:\n{path.read_text()[-4000:]}")
        time.sleep(0.05)
    pytest.fail(f"no {text!r} in {path} within {timeout_s} s:\n{path.read_text()[-4000:]}")


def spawn(fn, nproc: int, *args) -> None:
    """Run fn(rank, port, *args) in nproc forked processes (a rendezvous port is chosen here);
    raises if any rank fails."""
    import torch.multiprocessing as mp

    mp.start_processes(fn, args=(free_port(), *args), nprocs=nproc, start_method="fork")


def torchrun(nproc: int, args: list[str], timeout: int = 600, env: dict | None = None,
             check: bool = True, fresh: bool = False) -> subprocess.CompletedProcess:
    """Run `torchrun --standalone --nproc_per_node nproc <args>` from the repository root (nproc 0:
    plain `python <args>`, one process without torchrun); with check, fail the test with the
    output's tail on a non-zero exit.

    Where it fits one, the run is a job of the session's persistent world of nproc ranks instead
    (tests/worlds.py: nproc 0 is the world of one), with the same exit code and output: a worker script
    or module, or launch/ppo.py colocated, with no environment of its own. fresh=True (or
    MEGARL_TEST_WORLDS=0) always starts new processes, for a test about the processes themselves."""
    import worlds

    if not fresh and worlds.fits(nproc, args, env):
        w = worlds.world(max(nproc, 1))
        proc = w.ppo(args[1:], timeout=timeout) if args[0] == "launch/ppo.py" else w.script(args, timeout=timeout)
        if check and proc.returncode != 0:
            pytest.fail(f"torchrun {' '.join(args)} (a job of the world of {w.nproc}) exited {proc.returncode}:\n"
                        f"{(proc.stdout + proc.stderr)[-6000:]}")
        return proc
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    cmd = [sys.executable, *launcher, *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"torchrun {' '.join(args)} exited {proc.returncode}:\n{tail}")
    return proc


def stage_at_call(server, new: dict, at: int):
    """A `between_tokens` hook for an engine served by the RolloutServer `server`: at its `at`-th
    call it stages `new` as version 1 (as the receiving thread would mid-request), and every call
    loads what is staged (partial rollout: tests/async_rl/test_partial_rollout.py, tests/vllm)."""
    calls = []

    def between_tokens():
        calls.append(1)
        if len(calls) == at:
            server.staged = (1, new)
        server.load_staged()

    return between_tokens


def make_model(out: Path, arch: str, **overrides) -> Path:
    from megarl.tools.make_tiny_model import make_tiny_model

    if not (out / "config.json").exists():
        make_tiny_model(arch, out, **overrides)
    return out


def hub_cache(cache: Path, repo_id: str, model_dir: Path, commit: str, ref: str | None = "main") -> Path:
    """Put the files of `model_dir` into a Hugging Face hub cache by hand, laid out as huggingface_hub
    writes it (no network): models--org--name/blobs/<sha256>, snapshots/<commit>/<file> symlinked to
    its blob, refs/<ref> holding the commit. Returns the snapshot directory."""
    import hashlib

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for src in sorted(p for p in Path(model_dir).rglob("*") if p.is_file()):
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / src.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny model per family. The vocabulary (301) is divisible by neither 2 nor 4, so TP pads
    it; llama ties its embeddings, the others do not."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        arch: make_model(root / arch, arch, vocab_size=301, tie=(arch == "llama"), seed=FAMILIES.index(arch))
        for arch in FAMILIES
    }


# name -> (arch, make_tiny_model options): between them, q_lora_rank set and none, YaRN and plain
# rope, 1, 2 and 4 expert groups, tied and untied embeddings, MTP layers in the checkpoint; 8 experts
# (4 or 2 per group) so that the correction bias and the group choice both decide routes. Four
# layers, the first dense, so that uneven and virtual pipeline stages have layers to split.
TINY_671B = {
    "deepseek_v3": ("deepseek_v3", dict(experts=8, groups=2, topk_group=1, topk=2, yarn_factor=4.0, mtp_layers=1)),
    "deepseek_v3_noq_tied": ("deepseek_v3", dict(q_lora_rank=0, experts=8, groups=4, topk_group=2, topk=3, tie=True)),  # topk / topk_group != 2
    "glm4_moe": ("glm4_moe", dict(experts=8, groups=1, topk=2, mtp_layers=1)),
    "glm4_moe_tied": ("glm4_moe", dict(experts=8, groups=2, topk_group=1, topk=2, qk_norm=False, tie=True)),
}


@pytest.fixture(scope="session")
def tiny_moe_671b_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny DeepSeek-V3 and GLM-4.5 models (`TINY_671B`), vocabulary 301 (TP pads it), 4 layers: a
    dense first layer, then MoE layers."""
    root = tmp_path_factory.mktemp("tiny_moe_671b")
    return {name: make_model(root / name, arch, vocab_size=301, layers=4, seed=i, **options)
            for i, (name, (arch, options)) in enumerate(TINY_671B.items())}


@pytest.fixture(scope="module")
def world_of_one():
    """ParallelDims(world_size=1) initialised on gloo in this process; env and groups restored after."""
    import torch.distributed as dist

    from megarl.distributed.parallel import ParallelDims, _free_port

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


# ---------------------------------------------------------------------------------------------- durations
# `make test` names each tier (MEGARL_TEST_TIER=full / core / vllm / ...); a named tier writes its wall time
# and every test's duration (setup + call + teardown) into runs/test-durations.json, which
# tests/tier_budgets.py then reads against the budgets of docs/testing.md. Tiers run side by side (core
# and vLLM beside the full suite), so the file is updated under a lock.
_TIER_STARTED: list[float] = []
_TIER_DURATIONS: dict[str, float] = {}
_TIER_OUTCOMES: dict[str, str] = {}
# The machine's busy core-seconds (every process's, from /proc/stat) over the tier and over each test:
# a test's wall time times the cores minus these is what it left idle, which work beside it could have used.
_TIER_BUSY: dict[str, float] = {}
_TIER_BUSY_START: list[float] = []


def machine_busy_seconds() -> float | None:
    """CPU-seconds the whole machine has spent busy since boot (all cores; None off Linux)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def pytest_sessionstart(session):
    import time

    _TIER_STARTED.append(time.time())
    busy = machine_busy_seconds()
    if busy is not None:
        _TIER_BUSY_START.append(busy)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    wait_before_the_last_tests(item, say=reporter.write_line if reporter else print)  # outside the test's own time
    before = machine_busy_seconds()
    yield
    after = machine_busy_seconds()
    if before is not None and after is not None:
        _TIER_BUSY[item.nodeid] = _TIER_BUSY.get(item.nodeid, 0.0) + after - before


def pytest_runtest_logreport(report):
    _TIER_DURATIONS[report.nodeid] = _TIER_DURATIONS.get(report.nodeid, 0.0) + report.duration
    if report.when == "call" or report.outcome != "passed":
        _TIER_OUTCOMES[report.nodeid] = report.outcome


def pytest_collection_finish(session):
    """Start, niced, the background runs (tests/background.py) that the collected test modules declare
    in BACKGROUND_RUNS: they run while the tests before theirs do."""
    import background

    if session.config.option.collectonly or not background.enabled():
        return
    modules = {id(item.module): item.module for item in session.items if getattr(item, "module", None) is not None}
    for module in modules.values():
        for name, start_fn in getattr(module, "BACKGROUND_RUNS", {}).items():
            background.start(name, start_fn)


def pytest_sessionfinish(session, exitstatus):
    import background
    import shared_runs
    import worlds  # the persistent test worlds (tests/worlds.py) end with the session

    worlds.stop_all()
    background.stop_all()
    shared_runs.cleanup()
    tier = os.environ.get("MEGARL_TEST_TIER")
    if not tier or not _TIER_STARTED:
        return
    import fcntl
    import json
    import time

    out = REPO / "runs" / "test-durations.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    outcomes = list(_TIER_OUTCOMES.values())
    entry = {
        "wall_s": round(time.time() - _TIER_STARTED[0], 1),
        "collected": session.testscollected,
        "passed": outcomes.count("passed"),
        "failed": outcomes.count("failed"),
        "skipped": outcomes.count("skipped"),
        "exit_status": int(exitstatus),
        "python": sys.version.split()[0],
        "tests": {k: round(v, 2) for k, v in sorted(_TIER_DURATIONS.items(), key=lambda kv: -kv[1])},
        "cores": os.cpu_count(),
    }
    if os.environ.get("MEGARL_TEST_RAN_BESIDE"):  # make test's tiers-beside: the full suite had the cores first
        entry["ran_beside"] = os.environ["MEGARL_TEST_RAN_BESIDE"]
    if _WAITED_FOR_BESIDE:  # in wall_s, in no test's duration
        entry["waited_for_beside_s"] = round(_WAITED_FOR_BESIDE[0], 1)
    busy_end = machine_busy_seconds()
    if _TIER_BUSY_START and busy_end is not None:
        entry["busy_core_s"] = round(busy_end - _TIER_BUSY_START[0], 1)
        entry["tests_busy_core_s"] = {k: round(_TIER_BUSY.get(k, 0.0), 2) for k in entry["tests"]}
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(out.read_text()) if out.exists() and out.stat().st_size else {}
        data.setdefault("tiers", {})[tier] = entry
        out.write_text(json.dumps(data, indent=1) + "\n")
