"""Megatron-Core models agree with transformers, and HF -> mcore -> HF is bit-exact, for every
family under (1 process), (tp 2 with sequence parallelism), (pp 2), (tp 2 x pp 2) and, for MoE,
(ep 2) and (tp 2 x ep 2). (tests/models/test_parity_671b.py: the MLA families.)"""
from __future__ import annotations

import json

import pytest

from conftest import FAMILIES, torchrun

TOLERANCE = 1e-4  # float32, max |log-prob difference|


def _run(tiny_models, tmp_path, nproc: int, layouts: list[str]) -> list[dict]:
    out = tmp_path / "results.json"
    models = [str(tiny_models[a]) for a in FAMILIES]
    torchrun(nproc, ["tests/models/parity_worker.py", "--models", *models, "--layouts", *layouts, "--out", str(out)])
    return json.loads(out.read_text())


def _check(results: list[dict], expected_count: int) -> None:
    assert len(results) == expected_count, results
    for r in results:
        where = f"{r['model']} tp={r['tp']} pp={r['pp']} ep={r['ep']}"
        assert r["max_abs_diff"] <= TOLERANCE, f"{where}: log-probs differ from transformers by {r['max_abs_diff']}"
        assert not r["mismatched"], f"{where}: round trip changed {r['mismatched']}"
        assert not r["missing"], f"{where}: export lacks {r['missing']}"
        assert r["exported"] > 0


@pytest.mark.slow
def test_parity_one_process(tiny_models, tmp_path):
    _check(_run(tiny_models, tmp_path, 1, ["1,1,1"]), len(FAMILIES))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_parity_two_processes(tiny_models, tmp_path):
    # tp2 with sequence parallelism (megarl's default at tp > 1) and pp2 for all five families; ep2
    # for the two MoE families. (tp2 without it: the four-process launch's tp2 x pp2 and tests/layouts.)
    results = _run(tiny_models, tmp_path, 2, ["tp=2,sp=1", "1,2,1", "1,1,2"])
    _check(results, 2 * len(FAMILIES) + 2)
    assert sum(r["sp"] for r in results) == len(FAMILIES)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_parity_four_processes(tiny_models, tmp_path):
    # tp2 x pp2 for all families; tp2 x ep2 for the MoE families.
    _check(_run(tiny_models, tmp_path, 4, ["2,2,1", "2,1,2"]), len(FAMILIES) + 2)
