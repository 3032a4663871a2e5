"""The tools take hub ids too (issue 30): the planner's --model, eval_exact_match --model and
megarl.tools.logprobs --model give, for `org/name` read from a hand-built hub cache, exactly what
they give for the directory itself; an id not in the cache is one line and exit 2. HF_HUB_OFFLINE=1
throughout (no network). export_hf's default --model is tested end to end in
tests/trainer/test_hub_models.py."""
from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO, hub_cache, make_model, torchrun

sys.path.insert(0, str(REPO / "tests" / "capacity"))
from hf_configs import QWEN25_7B  # noqa: E402

COMMIT = "d" * 40


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hf-cache"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def test_planner_takes_a_hub_id(cache, tmp_path, capsys):
    from megarl.tools.plan import main

    src = tmp_path / "q7"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(QWEN25_7B))
    argv = ["--gpus", "8", "--tp", "4", "--json"]
    assert main(["--model", "Qwen/Qwen2.5-7B-Instruct", *argv, str(tmp_path / "miss.json")]) == 2
    assert capsys.readouterr().err.startswith("error: --model: Qwen/Qwen2.5-7B-Instruct is not a local directory and "
                                              f"not in the Hugging Face cache {cache}")
    hub_cache(cache, "Qwen/Qwen2.5-7B-Instruct", src, COMMIT)
    by_dir = main(["--model", str(src), *argv, str(tmp_path / "dir.json")])
    by_id = main(["--model", "Qwen/Qwen2.5-7B-Instruct", *argv, str(tmp_path / "id.json")])
    assert by_dir == by_id == 0
    assert (tmp_path / "id.json").read_text() == (tmp_path / "dir.json").read_text()


@pytest.fixture
def tiny_in_cache(cache, tmp_path):
    model = make_model(tmp_path / "tiny", "llama", tokenizer="digits", init_std=0.02)
    hub_cache(cache, "org/tiny", model, COMMIT)
    return model


def test_eval_exact_match_takes_a_hub_id(tiny_in_cache, tmp_path):
    from megarl.data.prepare import prepare_arithmetic
    from megarl.tools.eval_exact_match import exact_match

    prepare_arithmetic(tmp_path / "data", "copy", 3, 8, 8)
    data = [str(tmp_path / "data" / "test.parquet")]
    by_dir = exact_match(str(tiny_in_cache), data, max_new_tokens=4)
    assert exact_match("org/tiny", data, max_new_tokens=4) == by_dir
    assert exact_match(f"org/tiny@{COMMIT}", data, max_new_tokens=4) == by_dir
    assert by_dir["total"] == 8


@pytest.mark.slow  # two launches of the Megatron tool, one process each
def test_logprobs_takes_a_hub_id(tiny_in_cache, tmp_path, cache):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in ([1, 2, 3, 4], [5, 6, 7])))
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    for name, model in (("dir", str(tiny_in_cache)), ("id", "org/tiny")):
        torchrun(0, ["-m", "megarl.tools.logprobs", "--model", model, "--input", str(tmp_path / "in.jsonl"),
                     "--output", str(tmp_path / f"{name}.jsonl")], timeout=300, env=env)
    by_dir = [json.loads(line)["logprobs"] for line in (tmp_path / "dir.jsonl").read_text().splitlines()]
    assert [len(lp) for lp in by_dir] == [3, 2]
    assert (tmp_path / "id.jsonl").read_text() == (tmp_path / "dir.jsonl").read_text()
    missing = torchrun(0, ["-m", "megarl.tools.logprobs", "--model", "org/absent", "--input", str(tmp_path / "in.jsonl"),
                           "--output", str(tmp_path / "x.jsonl")], timeout=300, env=env, check=False)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"error: --model: org/absent is not a local directory and not in the Hugging Face cache {cache} (HF_HUB_OFFLINE "
        f"is set, so it is not downloaded): download it where there is network (unset HF_HUB_OFFLINE, or `hf download "
        f"org/absent`), or set HF_HUB_CACHE (or HF_HOME) to the cache that holds it"], missing.stderr
