"""DeepSeek-V3 (MLA, YaRN, group-limited sigmoid routing with a correction bias, shared experts, dense
first layers) and GLM-4.5 (partial rotary, q/k norm, attention bias, the same MoE) agree with
transformers in float32, and HF -> mcore -> HF is bit-exact (correction bias included, MTP layers
skipped), with every weight in some rank's weight-sync shards, at 1 process, tp2 with sequence
parallelism, pp2 (even and uneven), vpp2 x pp2, ep2, tp2 x ep2 with sequence parallelism, etp2 x ep2
and tp2 x pp2.

The variants (`conftest.TINY_671B`: q_lora_rank set and none, 1/2/4 expert groups, tied and untied
embeddings) run at every layout that is cheap to start; the pipeline layouts run on one model of
each family. Each torchrun launch checks all its layouts in a row (`parity_worker.py`): starting
processes costs more than these models' compute."""
from __future__ import annotations

import json

import pytest

from conftest import FAMILIES_671B, TINY_671B, torchrun

TOLERANCE = 1e-4  # float32, max |log-prob difference|
NAMES = list(TINY_671B)  # 0 deepseek_v3, 1 deepseek_v3_noq_tied, 2 glm4_moe, 3 glm4_moe_tied


def _run(models: dict, tmp_path, nproc: int, layouts: list[str]) -> list[dict]:
    out = tmp_path / f"results-{nproc}.json"
    torchrun(nproc, ["tests/models/parity_worker.py", "--models", *[str(models[n]) for n in NAMES],
                     "--layouts", *layouts, "--out", str(out)])
    return json.loads(out.read_text())


def _expected(layouts: list[str]) -> list[tuple[str, str]]:
    """(model name, layout) in the worker's order: model by model, its layouts in the given order."""
    def runs(i, layout):
        _, _, only = layout.partition("@")
        return not only or i in {int(x) for x in only.split(",")}
    return [(name, layout) for i, name in enumerate(NAMES) for layout in layouts if runs(i, layout)]


def _check(results: list[dict], layouts: list[str]) -> None:
    seen = [(r["model_dir"].rsplit("/", 1)[-1], r["layout"]) for r in results]
    assert seen == _expected(layouts), seen
    for (name, layout), r in zip(seen, results):
        where = f"{name} {layout}"
        assert r["max_abs_diff"] <= TOLERANCE, f"{where}: log-probs differ from transformers by {r['max_abs_diff']}"
        assert not r["mismatched"], f"{where}: round trip changed {r['mismatched']}"
        assert not r["missing"] and r["exported"] > 0, f"{where}: export lacks {r['missing']}"
        assert not r["unheld"], f"{where}: no rank's weight-sync shards hold {r['unheld']}"
        assert not r["mtp_exported"], f"{where}: multi-token-prediction tensors came back on export"
        assert (r["mtp_skipped"] > 0) == (TINY_671B[name][1].get("mtp_layers", 0) > 0), r["mtp_skipped"]
        assert r["chunks"] == (2 if "vpp=2" in layout else 1)
        assert r["sp"] == ("sp=1" in layout), where
    # each family at each layout
    for layout in layouts:
        assert {r["model"] for r in results if r["layout"] == layout} == set(FAMILIES_671B), layout


@pytest.mark.slow
def test_parity_one_process(tiny_moe_671b_models, tmp_path):
    layouts = ["1,1,1"]
    _check(_run(tiny_moe_671b_models, tmp_path, 1, layouts), layouts)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_parity_two_processes(tiny_moe_671b_models, tmp_path):
    layouts = ["tp=2,sp=1", "ep=2", "pp=2@1,2", "pp=2,first=1,last=3@0,3", "pp=2,vpp=2@0,2"]
    _check(_run(tiny_moe_671b_models, tmp_path, 2, layouts), layouts)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_parity_four_processes(tiny_moe_671b_models, tmp_path):
    layouts = ["tp=2,ep=2,sp=1", "ep=2,etp=2@0,3", "tp=2,pp=2@1,2"]
    _check(_run(tiny_moe_671b_models, tmp_path, 4, layouts), layouts)
