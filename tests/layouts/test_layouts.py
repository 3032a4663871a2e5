"""Issue 14's layouts give the numbers of one process: log-probs against transformers (float32),
bit-exact HF round trips and complete weight-sync shards, at pp2 even and uneven, vpp2 x pp2,
tp2 x ep2 (etp1, 2 ranks), etp2 x ep2 and tp2 x uneven pp2 (4 ranks). Tiny 4-layer models: llama
with tied embeddings (the tied head must follow the last chunk) and qwen3_moe (experts)."""
from __future__ import annotations

import json

import pytest

from conftest import make_model, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
TOLERANCE = 1e-4
ARCHS = ("llama", "qwen3_moe")


@pytest.fixture(scope="module")
def four_layer_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("four_layers")
    return [str(make_model(root / a, a, vocab_size=301, layers=4, tie=a == "llama", seed=7)) for a in ARCHS]


def _run(models, tmp_path, nproc: int, layouts: list[str]) -> list[dict]:
    out = tmp_path / f"layouts{nproc}.json"
    torchrun(nproc, ["tests/layouts/layout_worker.py", "--models", *models, "--layouts", *layouts, "--out", str(out)])
    return json.loads(out.read_text())


def _check(results: list[dict], expected: set[tuple[str, str]]) -> None:
    assert {(r["model"], r["layout"]) for r in results} == expected
    for r in results:
        where = f"{r['model']} {r['layout']}"
        assert r["layers_ok"], f"{where}: a chunk holds other layers than ParallelDims.chunk_layers says"
        assert r["max_abs_diff"] <= TOLERANCE, f"{where}: log-probs differ from transformers by {r['max_abs_diff']}"
        assert not r["mismatched"], f"{where}: round trip changed {r['mismatched']}"
        assert not r["missing"] and r["exported"] > 0, f"{where}: export lacks {r['missing']}"
        assert not r["unheld"], f"{where}: no rank's weight-sync shards hold {r['unheld']}"
        assert r["chunks"] == (2 if "vpp=2" in r["layout"] else 1)


def test_layouts_two_processes(four_layer_models, tmp_path):
    layouts = ["pp=2", "pp=2,first=1,last=3", "pp=2,first=3", "pp=2,vpp=2", "tp=2,ep=2,etp=1"]
    expected = {(a, lay) for a in ARCHS for lay in layouts if a == "qwen3_moe" or "ep=" not in lay}
    _check(_run(four_layer_models, tmp_path, 2, layouts), expected)


def test_layouts_four_processes(four_layer_models, tmp_path):
    layouts = ["ep=2,etp=2", "tp=2,pp=2,first=1,last=3"]
    expected = {("qwen3_moe", "ep=2,etp=2")} | {(a, layouts[1]) for a in ARCHS}
    _check(_run(four_layer_models, tmp_path, 4, layouts), expected)
