"""`python -m megarl.rollout.serve`'s argument checks (issue 41): an engine it does not have, or one
whose package is missing, is one line on stderr and exit 2, before the server joins anything."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import REPO


def _vllm_installed() -> bool:
    # tests/ is on sys.path here, where tests/vllm is found as a namespace package called "vllm"
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin not in (None, "namespace")


def test_an_unknown_engine_is_one_line_and_exit_2(tmp_path, capsys):
    from megarl.rollout.serve import main

    token = tmp_path / "fleet.token"
    token.write_text("t\n")
    assert main(["--trainer", "127.0.0.1:1", "--token-file", str(token), "--engine", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert err == ("megarl serve: --engine 'nosuch' is not a rollout server's engine: choose one of hf, vllm "
                   "(the run's rollout.engine)\n")


@pytest.mark.skipif(_vllm_installed(), reason="vllm is installed here: the server would build its engine")
def test_a_vllm_server_without_vllm_says_how_to_install_it_and_exits_2(tmp_path):
    """As a user runs it (a process of its own: no tests/vllm on its path), pointed at a port where
    no trainer listens: it must stop at the import, before joining."""
    token = tmp_path / "fleet.token"
    token.write_text("t\n")
    proc = subprocess.run([sys.executable, "-m", "megarl.rollout.serve", "--trainer", "127.0.0.1:1", "--token-file",
                           str(token), "--engine", "vllm"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""  # nothing joined: no log line
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("megarl serve: --engine vllm: the 'vllm' rollout engine needs vllm==")
    assert "pip install 'megarl[vllm]'" in lines[0] and "make venv-vllm" in lines[0]


def test_an_hf_server_under_torchrun_of_two_ranks_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """`torchrun --nproc_per_node N` is for a vLLM engine of rollout.tp = N; the hf engine is one
    process: said before anything is built or joined."""
    from megarl.rollout.serve import main

    token = tmp_path / "fleet.token"
    token.write_text("t\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--trainer", "127.0.0.1:1", "--token-file", str(token), "--engine", "hf"]) == 2
    assert capsys.readouterr().err == (
        "megarl serve: --engine hf runs one process per server, but torchrun started 2: start it with `python -m "
        "megarl.rollout.serve` (torchrun --nproc_per_node N is for --engine vllm at rollout.tp = N)\n")


def test_lockstep_hands_rank_0s_jobs_to_the_other_ranks():
    """rollout.tp > 1: each job rank 0 runs reaches the others whole and in order, a load with its
    weights' bytes (two ranks of a gloo group here, in two threads)."""
    import threading

    import torch

    from megarl.fleet import link
    from megarl.rollout.server_engines import Lockstep

    host = link.LinkHost("127.0.0.1", 30.0)
    offer = host.offer()
    groups = {}
    joiner = threading.Thread(target=lambda: groups.update(follower=link.join("127.0.0.1", offer)))
    joiner.start()
    leader = Lockstep(host.accept(offer))
    joiner.join(timeout=30)
    follower = Lockstep(groups["follower"])
    entries, flat = link.flatten([("w", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.ones(3))])
    jobs = [("welcome", {"model_config": {"model_type": "llama"}, "dtype": "float32", "max_model_len": 40}, None),
            ("load", {"tensors": entries, "version": 3, "bytes": flat.numel()}, flat),
            ("request", {"step": 2, "request_ids": [7], "prompt_ids": [[1, 2]]}, None), ("stop", {}, None)]
    got = []
    receiver = threading.Thread(target=lambda: got.extend(follower.receive() for _ in jobs))
    receiver.start()
    for kind, header, buffer in jobs:
        leader.send(kind, header, buffer)
    receiver.join(timeout=30)
    assert [(kind, header) for kind, header, _ in got] == [(kind, header) for kind, header, _ in jobs]
    assert got[0][2] is None and got[2][2] is None
    assert [(n, t.tolist()) for n, t in link.unflatten(entries, got[1][2])] == [
        ("w", [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]), ("b", [1.0, 1.0, 1.0])]
