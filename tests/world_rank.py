"""One rank of a persistent test world (tests/worlds.py): joins the world's process group once, then
runs the jobs the test process sends it, each inside that group, until told to stop.

A job is a whole `launch/ppo.py` run ({"kind": "ppo", "argv": [...]}: `Run` opened and closed inside the
existing group), a worker script or module run as `__main__` ({"kind": "script", "argv": ["tests/x/w.py",
...] or ["-m", "megarl.tools.logprobs", ...]}) or a function ({"kind": "call", "target": "module:function",
"args": [...]}). A script starts, as under torchrun, with no default group (it makes its own, on the
port the job names); a job that needs the world's group after a script ended it makes it again. Its
stdout and stderr (file descriptors 1 and 2, so C++ output too) go to the files the job names; the
answer is {"code": exit code, "result": the function's value, "reusable": whether the world can take
another job}. Started by tests/worlds.py, never by hand.
"""
from __future__ import annotations

import datetime
import gc
import importlib
import importlib.util
import os
import sys
import traceback
from multiprocessing.connection import Client
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def _exit_code(err: SystemExit) -> int:
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code
    print(err.code, file=sys.stderr)  # what Python does with SystemExit("message")
    return 1


def _run_script(argv: list[str]) -> int:
    import runpy

    saved = sys.argv
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            path = str(REPO / argv[0])
            sys.argv = [path, *argv[1:]]
            sys.path.insert(0, str(Path(path).parent))  # as `python path` puts the script's folder first
            try:
                runpy.run_path(path, run_name="__main__")
            finally:
                sys.path.remove(str(Path(path).parent))
    finally:
        sys.argv = saved
    return 0


def _join(port: str) -> None:
    """The world's default group, made again on this job's port when the last job ended it (a worker
    script that calls destroy_process_group, as it would at the end of its own process)."""
    import torch.distributed as dist

    from megarl.platform import init_platform

    if not dist.is_initialized():
        os.environ["MASTER_PORT"] = port
        dist.init_process_group(backend=init_platform().backend, timeout=datetime.timedelta(minutes=30))


def _launch_ppo():
    spec = importlib.util.spec_from_file_location("launch_ppo", REPO / "launch" / "ppo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leave(port: str) -> None:
    """No default group, as torchrun hands a script none: a worker script makes its own (on this job's
    port) and may end it; the next job that needs the world's group makes it again."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ["MASTER_PORT"] = port


def run_job(job: dict, ppo) -> dict:
    """Run one job with fds 1 and 2 in its files and its environment variables set; restore both after."""
    if job["kind"] == "script":
        _leave(job["port"])
    else:
        _join(job["port"])
    import torch.distributed as dist

    from megarl.platform import process_groups

    # what c10d holds before the job: the groups a job made and left (a function that built Megatron's
    # groups itself) are destroyed after it, or each would keep its gloo threads in this rank for good
    before = process_groups.registered_groups() if dist.is_initialized() else None
    saved_env = dict(os.environ)
    os.environ.update(job.get("env") or {})
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    result, code = None, 0
    with open(job["stdout"], "w") as out, open(job["stderr"], "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            if job["kind"] == "ppo":
                code = ppo.main(list(job["argv"])) or 0
            elif job["kind"] == "script":  # `python SCRIPT ARGS` or `python -m MODULE ARGS`, as __main__
                code = _run_script(list(job["argv"]))
            else:
                module, name = job["target"].split(":")
                result = getattr(importlib.import_module(module), name)(*job.get("args", []), **job.get("kwargs", {}))
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:  # noqa: BLE001 - reported as the job's failure, like an uncaught exception
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    os.environ.clear()
    os.environ.update(saved_env)
    _tidy(before)
    return {"code": code, "result": result}


def _tidy(before: frozenset | None) -> None:
    """Megatron's state and models forgotten after a job, and every group the job made and left (the next job makes the
    world's default group again if this one ended it)."""
    import torch.distributed as dist

    from megarl.distributed.parallel import forget_megatron_models
    from megarl.platform import process_groups

    # also after a worker script, which ended the default group but left Megatron's state set
    forget_megatron_models()
    if before is not None and dist.is_initialized():
        process_groups.destroy_groups_since(before)
    gc.collect()


def main() -> int:
    import torch.distributed as dist

    host, port = os.environ["MEGARL_WORLD_DRIVER"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["MEGARL_WORLD_KEY"]))
    conn.send(int(os.environ["RANK"]))
    _join(os.environ["MASTER_PORT"])
    ppo = _launch_ppo()
    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            break
        answer = run_job(job, ppo)
        answer["reusable"] = answer["code"] == 0
        conn.send(answer)
        if not answer["reusable"]:
            break
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # the guard matters: Megatron's checkpoint writer spawns processes
    sys.exit(main())
