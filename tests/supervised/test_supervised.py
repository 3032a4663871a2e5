"""The supervised stages' pieces: the losses (hand-worked values, the Bradley-Terry score gradients
against autograd), reading and refusing rows (file, row and column named; bad_rows=skip counts),
the prepare_data formats, and bad input through launch/sft.py and launch/reward_model.py (exit 2, one line)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from supervised_helpers import make_inputs  # noqa: E402

from conftest import torchrun  # noqa: E402
from megarl.supervised.data import PreferencePair, RowOrder, SftExample, read_rows  # noqa: E402
from megarl.supervised.losses import bradley_terry, bradley_terry_score_grads, sft_loss_contribution  # noqa: E402


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("supervised_inputs"))


@pytest.fixture(scope="module")
def tokenizer(inputs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(inputs["model"])


def write(path: Path, columns: dict) -> str:
    pq.write_table(pa.table(columns), path)
    return str(path)


# --- losses -------------------------------------------------------------------------------------------------
def test_sft_loss_is_the_token_mean_over_the_global_batch():
    # two micro-batches of one global batch with 4 response tokens: contributions sum to the token mean
    first = sft_loss_contribution(torch.tensor([[-1.0, -3.0, -9.0]]), torch.tensor([[1.0, 1.0, 0.0]]), 4)
    second = sft_loss_contribution(torch.tensor([[-0.5, -1.5]]), torch.tensor([[1.0, 1.0]]), 4)
    assert float(first) == pytest.approx(1.0)  # (1 + 3) / 4; the masked -9 counts for nothing
    assert float(first + second) == pytest.approx((1 + 3 + 0.5 + 1.5) / 4)


def test_bradley_terry_values_and_score_gradients():
    out = bradley_terry(torch.tensor([1.0, 2.0, 0.0]), torch.tensor([1.0, 0.0, 3.0]))
    assert out["loss"].tolist() == pytest.approx([math.log(2), math.log(1 + math.exp(-2)), math.log(1 + math.exp(3))])
    assert out["accuracy"].tolist() == [0.0, 1.0, 0.0]  # a tie is not a win
    assert out["margin"].tolist() == [0.0, 2.0, -3.0]
    chosen = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([0.1, 0.4, 2.5], dtype=torch.float64, requires_grad=True)
    (bradley_terry(chosen, rejected)["loss"].sum() / 5).backward()  # the mean over a global batch of 5 pairs
    grad_c, grad_r = bradley_terry_score_grads(chosen.detach(), rejected.detach(), 5)
    assert torch.allclose(grad_c, chosen.grad) and torch.allclose(grad_r, rejected.grad)
    assert torch.equal(grad_c, -grad_r)  # the head's bias gets no gradient (EngineConfig.train_value_head_bias)


# --- rows ---------------------------------------------------------------------------------------------------
def test_sft_rows_mask_the_prompt_and_end_with_eos(inputs, tokenizer):
    rows = read_rows([inputs["sft_train"]], "sft", tokenizer, max_length=16)
    first = pq.read_table(inputs["sft_train"]).to_pylist()[0]
    assert rows[0] == SftExample(tuple(tokenizer.encode(first["prompt"])),
                                 tuple(tokenizer.encode(first["response"], add_special_tokens=False)) + (tokenizer.eos_token_id,))
    pairs = read_rows([inputs["pairs_train"]], "preference", tokenizer, max_length=16)
    row = pq.read_table(inputs["pairs_train"]).to_pylist()[0]
    # as megarl.rewards.model.RewardModel encodes the text it scores
    assert pairs[0] == PreferencePair(tuple(tokenizer.encode(row["prompt"] + row["chosen"])),
                                      tuple(tokenizer.encode(row["prompt"] + row["rejected"])))


@pytest.mark.parametrize("kind,columns,expected", [
    ("sft", {"prompt": ["1=", "2="], "answer": ["1", "2"]}, "has no column 'response'"),
    ("sft", {"prompt": ["1=", "2="], "response": ["1", " "]}, "row 1 column 'response': empty"),
    ("sft", {"prompt": ["1=", "2="], "response": ["1", "2" * 30]}, "row 1 column 'response': 33 tokens, longer than supervised.max_length = 16"),
    ("preference", {"prompt": ["1="], "chosen": ["1"]}, "has no column 'rejected'"),
    ("preference", {"prompt": ["1=", "2="], "chosen": ["1", "2"], "rejected": ["3", "2"]}, "row 1 column 'rejected': equals column 'chosen'"),
    ("preference", {"prompt": ["1=", "2="], "chosen": ["", "2"], "rejected": ["3", "4"]}, "row 0 column 'chosen': empty"),
], ids=["missing-column", "empty-response", "too-long", "missing-rejected", "chosen-equals-rejected", "empty-chosen"])
def test_bad_rows_name_file_row_and_column(tmp_path, tokenizer, kind, columns, expected):
    path = write(tmp_path / "bad.parquet", columns)
    with pytest.raises(ValueError) as err:
        read_rows([path], kind, tokenizer, max_length=16)
    assert f"data file {path}" in str(err.value) and expected in str(err.value) and "\n" not in str(err.value)


def test_bad_rows_skip_counts_them(tmp_path, tokenizer):
    path = write(tmp_path / "pairs.parquet", {"prompt": ["1=", "2=", "3="], "chosen": ["1", "2", "3"], "rejected": ["4", "2", "3"]})
    said = []
    rows = read_rows([path], "preference", tokenizer, max_length=16, bad_rows="skip", log=said.append)
    assert len(rows) == 1 and len(said) == 1
    assert said[0].startswith(f"skipped 2 of 3 rows of data file {path}") and "row 1 column 'rejected'" in said[0]


class ChatTokenizer:
    """A chat template of its own: '<role>:' tokens, content as character codes, eos 2 closing each turn."""

    eos_token_id = 2

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        ids = []
        for m in messages:
            ids += [10 + len(m["role"])] + [ord(c) for c in m["content"]] + [2]
        return ids + ([10 + len("assistant")] if add_generation_prompt else [])


def test_messages_rows_train_on_the_last_assistant_turn(tmp_path):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path = write(tmp_path / "chat.parquet", {"messages": [chat, chat[:1]]})
    with pytest.raises(ValueError, match="row 1 column 'messages': the last message .* role 'assistant'"):
        read_rows([path], "sft", ChatTokenizer(), max_length=32)
    path = write(tmp_path / "chat1.parquet", {"messages": [chat]})
    (row,) = read_rows([path], "sft", ChatTokenizer(), max_length=32)
    assert row.prompt_ids == (14, ord("h"), ord("i"), 2, 19) and row.response_ids == (ord("y"), ord("o"), 2)


def test_row_order_is_the_same_global_batch_on_every_layout():
    one = RowOrder(10, 4, dp_rank=0, dp_size=1, seed=5)
    halves = [RowOrder(10, 4, dp_rank=r, dp_size=2, seed=5) for r in range(2)]
    for _ in range(3):  # two steps per epoch: the third starts epoch 1 with a new permutation
        batch = one.next_step()
        assert all(h.next_step() == batch for h in halves) and len(set(batch)) == 4
    assert [list(h.my_block) for h in halves] == [[0, 1], [2, 3]] and one.epoch == 1
    resumed = RowOrder(10, 4, dp_rank=0, dp_size=1, seed=5)
    resumed.load_state_dict(one.state_dict())
    assert resumed.next_step() == one.next_step()


# --- prepare_data ---------------------------------------------------------------------------------------------
def test_prepare_data_writes_both_formats_from_jsonl(tmp_path):
    from launch.prepare_data import main as prepare

    sft = tmp_path / "sft.jsonl"
    sft.write_text("\n".join(json.dumps(r) for r in [{"prompt": "1=", "response": "1"}, {"prompt": "2=", "ground_truth": "2"}]))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "1=", "chosen": "1", "rejected": "7"}) + "\n")
    assert prepare(["sft", "--out", str(tmp_path / "s"), "--input", str(sft)]) == 0
    assert pq.read_table(tmp_path / "s" / "train.parquet").to_pylist() == [{"prompt": "1=", "response": "1"},
                                                                           {"prompt": "2=", "response": "2"}]
    assert prepare(["preference", "--out", str(tmp_path / "p"), "--input", str(pairs)]) == 0
    assert pq.read_table(tmp_path / "p" / "train.parquet").to_pylist() == [{"prompt": "1=", "chosen": "1", "rejected": "7"}]
    pairs.write_text(json.dumps({"prompt": "1=", "chosen": "1"}) + "\n")
    assert prepare(["preference", "--out", str(tmp_path / "q"), "--input", str(pairs)]) == 2


def test_arithmetic_pairs_set_the_answer_against_a_wrong_one(tmp_path):
    from megarl.data.prepare import prepare_arithmetic_formats

    written = prepare_arithmetic_formats(tmp_path, "preference", train_size=200, val_size=10, train_offset=7)
    rows = pq.read_table(written["train"]).to_pylist()
    assert all(r["chosen"] == r["prompt"][:-1] != r["rejected"] for r in rows)  # copy: the answer is the digits
    lengths = {len(r["rejected"]) for r in rows}
    assert lengths == {2, 3, 4}  # dropped, changed / swapped / random, extra digit


# --- through the launch scripts ---------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.parametrize("script,columns,expected", [
    ("launch/sft.py", {"prompt": ["1=", "2="], "response": ["1", ""]}, "row 1 column 'response': empty"),
    ("launch/reward_model.py", {"prompt": ["1="], "chosen": ["1"], "reject": ["2"]}, "has no column 'rejected'"),
], ids=["sft-empty-response", "rm-missing-column"])
def test_bad_data_exits_2_with_one_line(tmp_path, inputs, script, columns, expected):
    path = write(tmp_path / "bad.parquet", columns)
    proc = torchrun(0, [script, "--config", "configs/tiny_cpu_sft.yaml", f"model.path={inputs['model']}",
                        "model.make_tiny.enable=false", f"data.train_files=[{path}]", "data.val_files=[]",
                        f"trainer.run_dir={tmp_path / 'run'}"], timeout=300, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0] and path in lines[0], proc.stderr
