"""Issue 14's layouts give the numbers of one process: log-probs against transformers (float32),
bit-exact HF round trips and complete weight-sync shards, at pp2 even and uneven, vpp2 x pp2,
tp2 x ep2 (etp1, 2 ranks), etp2 x ep2 and tp2 x uneven pp2 (4 ranks). Tiny 4-layer models: llama
with tied embeddings (the tied head must follow the last chunk) and qwen3_moe (experts)."""
from __future__ import annotations

import json
import os
import shlex

import pytest

from conftest import make_model, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
TOLERANCE = 1e-4
ARCHS = ("llama", "qwen3_moe")


@pytest.fixture(scope="module")
def four_layer_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("four_layers")
    return [str(make_model(root / a, a, vocab_size=301, layers=4, tie=a == "llama", seed=7)) for a in ARCHS]


def _run(models, tmp_path, nproc: int, layouts: list[str], cli: list[str] = ()) -> list[dict]:
    out = tmp_path / f"layouts{nproc}.json"
    extra = ["--cli", shlex.join(cli)] if cli else []
    torchrun(nproc, ["tests/layouts/layout_worker.py", "--models", *models, "--layouts", *layouts, "--out", str(out), *extra])
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
    # and the command line with the new layout flags, on the same two processes
    ids = [[5, 17, 200, 3, 9, 44, 120], [7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in ids))
    cli = ["--model", four_layer_models[0], "--pp", "2", "--vpp", "2", "--first-stage-layers", "2",
           "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    _check(_run(four_layer_models, tmp_path, 2, layouts, cli), expected)
    got = [json.loads(line)["logprobs"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    reference = _hf_logprobs(four_layer_models[0], ids)
    assert [len(g) for g in got] == [len(s) - 1 for s in ids]
    assert max(abs(a - b) for g, r in zip(got, reference) for a, b in zip(g, r)) <= TOLERANCE


def _hf_logprobs(model_dir: str, ids: list[list[int]]) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for seq in ids:
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0], -1)
            out.append(logp[:-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].tolist())
    return out


@pytest.mark.parametrize("flags,message", [
    (["--vpp", "2"], "parallel.vpp = 2 needs parallel.pp > 1"),
    (["--pp", "2", "--vpp", "2", "--first-stage-layers", "2", "--last-stage-layers", "2"], "set only one of them"),
])
def test_logprobs_layout_flags_refuse_bad_layouts(four_layer_models, tmp_path, flags, message):
    import subprocess
    import sys

    from conftest import REPO

    (tmp_path / "in.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    # WORLD_SIZE=2 as torchrun would set it: the layout is refused before any process group exists
    env = dict(os.environ, WORLD_SIZE="2") if "--pp" in flags else None
    proc = subprocess.run([sys.executable, "-m", "megarl.tools.logprobs", "--model", four_layer_models[0], *flags,
                           "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl")],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr


def test_layouts_four_processes(four_layer_models, tmp_path):
    # etp2 x ep2 needs 4 ranks per stage; tp2 x uneven pp2 comes along (the start-up is the cost)
    layouts = ["ep=2,etp=2", "tp=2,pp=2,first=1,last=3"]
    _check(_run(four_layer_models[1:], tmp_path, 4, layouts), {("qwen3_moe", lay) for lay in layouts})
