"""Dataset preparation and the prompt dataset (megarl.data)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.config import load_config
from megarl.data.arithmetic import ArithmeticTask
from megarl.data.batching import pad_left, pad_right
from megarl.data.dataset import PromptDataset, encode_prompt, read_prompt_files
from megarl.data.prepare import (DEFAULT_GSM8K_DIR, gsm8k_final_answer, prepare_gsm8k,
                                 prepare_if_missing, read_gsm8k_jsonl, write_parquet)

REPO = Path(__file__).resolve().parents[2]
COLUMNS = ["prompt", "ground_truth", "data_source", "extra"]


def _rows(n: int) -> list[dict]:
    return [{"prompt": f"p{i}", "ground_truth": str(i), "data_source": "test", "extra": {"i": i}} for i in range(n)]


@pytest.fixture
def ten_rows(tmp_path) -> Path:
    path = tmp_path / "ten.parquet"
    write_parquet(_rows(10), path)
    return path


def test_arithmetic_task_rows_are_deterministic_and_correct():
    copy = ArithmeticTask("copy", 3)
    assert copy.sample(7) == copy.sample(7)
    row = copy.sample(7)
    assert row["prompt"] == row["ground_truth"] + "=" and len(row["ground_truth"]) == 3
    rep = ArithmeticTask("repeat", 4).sample(1)
    assert rep["ground_truth"] == rep["prompt"][0] * 4 and rep["prompt"].endswith(";4=")
    add = ArithmeticTask("add", 2).sample(3)
    a, b = add["prompt"].rstrip("=").split("+")
    assert int(add["ground_truth"]) == int(a) + int(b)
    with pytest.raises(ValueError, match="not one of copy, repeat, add"):
        ArithmeticTask("mul")


def test_prepare_arithmetic_via_cli(tmp_path):
    out = tmp_path / "arith"
    proc = subprocess.run([sys.executable, "launch/prepare_data.py", "arithmetic", "--out", str(out),
                           "--train-size", "50", "--val-size", "8"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    train = pq.read_table(out / "train.parquet")
    assert train.column_names == COLUMNS and train.num_rows == 50
    assert pq.read_table(out / "test.parquet").num_rows == 8
    first = train.slice(0, 1).to_pylist()[0]
    assert first["data_source"] == "arithmetic/copy" and json.loads(first["extra"])["split"] == "train"
    assert all(t == p.rstrip("=") for p, t in zip(train.column("prompt").to_pylist(),
                                                   train.column("ground_truth").to_pylist()))


def test_prepare_gsm8k_from_the_shared_copy(tmp_path):
    if not (DEFAULT_GSM8K_DIR / "train.jsonl").exists():
        pytest.skip(f"GSM8K not present at {DEFAULT_GSM8K_DIR}")
    written = prepare_gsm8k(tmp_path / "gsm8k")
    train = pq.read_table(written["train"])
    assert train.column_names == COLUMNS and train.num_rows == 7473
    assert pq.read_table(written["test"]).num_rows == 1319
    row = train.slice(0, 1).to_pylist()[0]
    assert row["ground_truth"] == "72" and row["data_source"] == "openai/gsm8k"
    assert row["prompt"].startswith("Natalia sold clips") and row["prompt"].endswith('after "####".')


def test_prepare_gsm8k_from_a_small_jsonl_and_its_errors(tmp_path):
    src = tmp_path / "tiny.jsonl"
    src.write_text(json.dumps({"question": "1+1?", "answer": "so\n#### 1,002"}) + "\n\n")
    written = prepare_gsm8k(tmp_path / "out", src)
    assert pq.read_table(written["train"]).column("ground_truth").to_pylist() == ["1002"]
    assert gsm8k_final_answer("x #### -3") == "-3"
    src.write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(ValueError, match=r"tiny.jsonl:1: not a GSM8K record"):
        read_gsm8k_jsonl(src, "train")
    with pytest.raises(ValueError, match="GSM8K input not found: no .*nowhere/train.jsonl"):
        prepare_gsm8k(tmp_path / "out", tmp_path / "nowhere")


def test_auto_prepare_writes_the_configured_files(tmp_path):
    train, val = tmp_path / "d" / "train.parquet", tmp_path / "d" / "val.parquet"
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml",
                      [f"data.train_files=[{train}]", f"data.val_files=[{val}]", "data.arithmetic.train_size=64",
                       "data.arithmetic.val_size=4"])
    assert prepare_if_missing(cfg.data) is True
    assert pq.read_table(train).num_rows == 64 and pq.read_table(val).num_rows == 4
    assert prepare_if_missing(cfg.data) is False  # present now: left alone


def test_auto_prepare_gsm8k_from_a_source_dir(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 4"}) + "\n")
    out = tmp_path / "out"
    cfg = load_config(None, ["model.path=m", f"data.train_files=[{out}/train.parquet]", "data.auto_prepare=gsm8k",
                             f"data.gsm8k_source={src}"])
    assert prepare_if_missing(cfg.data) is True
    assert pq.read_table(out / "train.parquet").column("ground_truth").to_pylist() == ["4"]
    cfg = load_config(None, ["model.path=m", f"data.train_files=[{out}/t2.parquet]", f"data.val_files=[{out}/v.parquet]",
                             "data.auto_prepare=gsm8k", f"data.gsm8k_source={src}"])
    with pytest.raises(ValueError, match="data.auto_prepare=gsm8k: no test.jsonl next to"):
        prepare_if_missing(cfg.data)


def test_shards_cover_the_step_and_carry_global_indices(ten_rows):
    whole = PromptDataset([ten_rows], prompts_per_step=4, seed=3)
    ranks = [PromptDataset([ten_rows], prompts_per_step=4, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    for _ in range(5):  # crosses an epoch boundary (2 steps per epoch)
        expected = whole.next_step()
        got = [row for ds in ranks for row in ds.next_step()]
        assert [(r.global_index, r.row, r.prompt) for r in got] == [(r.global_index, r.row, r.prompt) for r in expected]
        assert [r.global_index for r in got] == [0, 1, 2, 3]


def test_epochs_are_seeded_permutations(ten_rows):
    ds = PromptDataset([ten_rows], prompts_per_step=5, seed=0)
    epoch0 = [r.row for _ in range(2) for r in ds.next_step()]
    epoch1 = [r.row for _ in range(2) for r in ds.next_step()]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1  # reshuffled
    again = PromptDataset([ten_rows], prompts_per_step=5, seed=0)
    assert [r.row for _ in range(2) for r in again.next_step()] == epoch0
    other_seed = PromptDataset([ten_rows], prompts_per_step=5, seed=1)
    assert [r.row for _ in range(2) for r in other_seed.next_step()] != epoch0
    unshuffled = PromptDataset([ten_rows], prompts_per_step=5, shuffle=False)
    assert [r.row for r in unshuffled.next_step()] == [0, 1, 2, 3, 4]


def test_an_incomplete_last_batch_is_skipped(ten_rows):
    ds = PromptDataset([ten_rows], prompts_per_step=4, shuffle=False)
    assert ds.steps_per_epoch == 2
    seen = [r.row for _ in range(3) for r in ds.next_step()]
    assert seen == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]


def test_resume_position_continues_exactly(ten_rows):
    ds = PromptDataset([ten_rows], prompts_per_step=4, dp_rank=1, dp_size=2, seed=5)
    for _ in range(3):
        ds.next_step()
    state = json.loads(json.dumps(ds.state_dict()))  # survives a JSON round trip
    expected = [[r.row for r in ds.next_step()] for _ in range(3)]
    resumed = PromptDataset([ten_rows], prompts_per_step=4, dp_rank=1, dp_size=2, seed=5)
    resumed.load_state_dict(state)
    assert [[r.row for r in resumed.next_step()] for _ in range(3)] == expected
    with pytest.raises(ValueError, match="checkpoint has seed = 5, this run has 6"):
        PromptDataset([ten_rows], prompts_per_step=4, seed=6).load_state_dict(state)


def test_overlong_prompts_are_dropped_and_counted(tmp_path):
    path = tmp_path / "p.parquet"
    write_parquet([{"prompt": "x" * n, "ground_truth": "", "data_source": "t"} for n in (1, 2, 3, 4, 5, 6)], path)
    logged = []
    ds = PromptDataset([path], prompts_per_step=2, tokenizer=lambda s: [0] * len(s), max_prompt_tokens=4,
                       shuffle=False, log=logged.append)
    assert len(ds) == 4 and ds.num_dropped == 2
    assert logged == ["dropped 2 of 6 prompts longer than data.max_prompt_tokens = 4 tokens"]
    assert [r.prompt_ids for r in ds.next_step()] == [[0], [0, 0]]


def test_encode_prompt_with_a_transformers_tokenizer(tmp_path):
    from megarl.tools.make_tiny_model import build_tokenizer

    tok = build_tokenizer("digits", tmp_path / "tok")
    ids = encode_prompt(tok, "472=")
    assert tok.decode(ids, skip_special_tokens=True) == "472="
    assert len([i for i in ids if i not in tok.all_special_ids]) == 4


def test_unreadable_and_malformed_files_are_named(tmp_path, ten_rows):
    with pytest.raises(ValueError, match="data file not found: .*missing.parquet"):
        read_prompt_files([tmp_path / "missing.parquet"])
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(ValueError, match="data file .*junk.parquet is not a readable Parquet file"):
        read_prompt_files([junk])
    with pytest.raises(ValueError, match=r"ten.parquet has no column 'question' \(set data.prompt_key\); "
                                         r"its columns are: prompt, ground_truth, data_source, extra"):
        read_prompt_files([ten_rows], prompt_key="question")
    chat = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "hi"}]], "ground_truth": ["1"]}), chat)
    with pytest.raises(ValueError, match=r"chat.parquet row 0: column 'prompt' holds list, expected text"):
        read_prompt_files([chat])
    bad_extra = tmp_path / "extra.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "ground_truth": ["1"], "extra": ["{oops"]}), bad_extra)
    with pytest.raises(ValueError, match=r"extra.parquet row 0: column 'extra' is not JSON"):
        read_prompt_files([bad_extra])
    with pytest.raises(ValueError, match=r"10 usable prompts, fewer than data.prompts_per_step = 16"):
        PromptDataset([ten_rows], prompts_per_step=16)


def test_padding_helpers():
    ids, mask = pad_left([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, mask = pad_right([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
