"""KeptMassRecorder's bookkeeping (megarl/rollout/vllm_kept_mass.py) driven the way vLLM's V1
persistent batch drives it: requests added, removed, moved and swapped between rows must keep each
record under its own request and position. No engine: vLLM's real BatchUpdate and top-k/top-p code.
The engine end to end: tests/vllm/test_vllm_engine.py."""
from __future__ import annotations

import math
import types

import pytest
import torch

import vllm_models  # noqa: F401  (MEGARL_REQUIRE_VLLM=1: a missing vllm is an error, not a skip)

# the recorder subclasses vLLM's logits processor: without vllm (the main .venv) nothing here runs
pytest.importorskip("vllm.v1", reason="vllm is not installed here; `make test-vllm` runs this tier")
from megarl.rollout.vllm_kept_mass import KEY, RECORDS, KeptMassRecorder


def _recorder(vocab=6):
    config = types.SimpleNamespace(model_config=types.SimpleNamespace(get_vocab_size=lambda: vocab))
    return KeptMassRecorder(config, torch.device("cpu"), False)


def _params(tag=None, top_k=0, top_p=1.0):
    from vllm import SamplingParams

    return SamplingParams(top_k=top_k, top_p=top_p, extra_args={KEY: tag} if tag else None)


def test_records_follow_requests_through_moves_and_swaps():
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    RECORDS.clear()
    rec = _recorder()
    out_a, out_b, out_c = [], [7], []
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0, 0.0]] * 3) + 1e-30)
    rec.update_state(BatchUpdate(3, removed=[], moved=[], added=[
        (0, _params("a", top_k=2), None, out_a), (1, _params("b", top_k=1), None, out_b), (2, _params(), None, out_c)]))
    rec.apply(logits.clone())
    assert RECORDS["a"] == {0: pytest.approx(math.log(0.7), abs=1e-6)}  # top-2 keep 0.4 + 0.3
    assert RECORDS["b"] == {1: pytest.approx(math.log(0.4), abs=1e-6)}  # position = tokens generated so far
    assert set(RECORDS) == {"a", "b"}  # untagged requests are not recorded
    # a and b swap rows; the untagged request leaves and a new tagged one takes its row
    out_a.append(3)
    out_b.append(4)
    rec.update_state(BatchUpdate(3, removed=[2], added=[(2, _params("c", top_p=0.5), None, [])],
                                 moved=[(0, 1, MoveDirectionality.SWAP)]))
    rows = torch.log(torch.tensor([[0.2, 0.35, 0.25, 0.2, 0, 0], [0.4, 0.3, 0.2, 0.1, 0, 0], [0.6, 0.4, 0, 0, 0, 0]]) + 1e-30)
    rec.apply(rows.clone())
    assert RECORDS["b"][2] == pytest.approx(math.log(0.35), abs=1e-6)  # b (top-1) now reads row 0
    assert RECORDS["a"][1] == pytest.approx(math.log(0.7), abs=1e-6)  # a (top-2) now reads row 1
    assert RECORDS["c"][0] == pytest.approx(math.log(0.6), abs=1e-6)  # top-p 0.5 keeps the 0.6 token
    # a one-way move: c goes to row 0 (b removed first)
    rec.update_state(BatchUpdate(2, removed=[0], added=[], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    assert rec.rows[0][0] == "c" and 2 not in rec.rows
    RECORDS.clear()


def test_logits_leave_unchanged():
    from vllm.v1.sample.logits_processor import BatchUpdate

    rec = _recorder()
    rec.update_state(BatchUpdate(1, removed=[], moved=[], added=[(0, _params("x", top_k=1), None, [])]))
    logits = torch.randn(1, 6)
    assert torch.equal(rec.apply(logits.clone()), logits)
    RECORDS.clear()
