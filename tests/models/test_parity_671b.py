"""DeepSeek-V3 (MLA, YaRN, group-limited sigmoid routing with a correction bias, shared experts, dense
first layers) and GLM-4.5 (partial rotary, q/k norm, attention bias, the same MoE) agree with
transformers in float32, and HF -> mcore -> HF is bit-exact (correction bias included, MTP layers
skipped), at 1 process, tp2, pp2, ep2 and tp2 x ep2. The variants (`conftest.TINY_671B`) cover
q_lora_rank set and none, 1/2/4 expert groups, tied and untied embeddings.

Each torchrun launch checks several layouts in a row (`parity_worker.py`): starting processes
costs more than these models' compute."""
from __future__ import annotations

import json

import pytest

from conftest import TINY_671B, torchrun

TOLERANCE = 1e-4  # float32, max |log-prob difference|


def _run(models: dict, tmp_path, nproc: int, names: list[str], layouts: list[str]) -> list[dict]:
    out = tmp_path / f"results-{nproc}.json"
    torchrun(nproc, ["tests/models/parity_worker.py", "--models", *[str(models[n]) for n in names],
                     "--layouts", *layouts, "--out", str(out)])
    return json.loads(out.read_text())


def _check(results: list[dict], expected: list[tuple[str, str]]) -> None:
    seen = [(r["model_dir"].rsplit("/", 1)[-1], f"{r['tp']},{r['pp']},{r['ep']}") for r in results]
    assert seen == expected, seen
    for r in results:
        where = f"{r['model_dir'].rsplit('/', 1)[-1]} tp={r['tp']} pp={r['pp']} ep={r['ep']}"
        assert r["max_abs_diff"] <= TOLERANCE, f"{where}: log-probs differ from transformers by {r['max_abs_diff']}"
        assert not r["mismatched"], f"{where}: round trip changed {r['mismatched']}"
        assert not r["missing"], f"{where}: export lacks {r['missing']}"
        assert not r["mtp_exported"], f"{where}: multi-token-prediction tensors came back on export"
        has_mtp = TINY_671B[r["model_dir"].rsplit("/", 1)[-1]][1].get("mtp_layers", 0) > 0
        assert (r["mtp_skipped"] > 0) == has_mtp, r["mtp_skipped"]
        assert r["exported"] > 0


@pytest.mark.slow
def test_parity_one_process(tiny_moe_671b_models, tmp_path):
    names = list(TINY_671B)
    _check(_run(tiny_moe_671b_models, tmp_path, 1, names, ["1,1,1"]), [(n, "1,1,1") for n in names])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_parity_two_processes(tiny_moe_671b_models, tmp_path):
    names, layouts = list(TINY_671B), ["2,1,1", "1,2,1", "1,1,2"]
    _check(_run(tiny_moe_671b_models, tmp_path, 2, names, layouts), [(n, lay) for n in names for lay in layouts])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_parity_four_processes(tiny_moe_671b_models, tmp_path):
    # tp2 x ep2 for every variant; tp2 x pp2 for one of each family
    names = list(TINY_671B)
    results = _run(tiny_moe_671b_models, tmp_path, 4, names, ["2,1,2"])
    results += _run(tiny_moe_671b_models, tmp_path, 4, ["deepseek_v3", "glm4_moe"], ["2,2,1"])
    _check(results, [(n, "2,1,2") for n in names] + [("deepseek_v3", "2,2,1"), ("glm4_moe", "2,2,1")])
