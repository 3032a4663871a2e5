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
