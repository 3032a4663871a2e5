"""Data inputs a user gets wrong (issue 11, items 13 and 14): auto_prepare never writes a path typed
on the command line, a directory given as a data file is called a directory, a missing tokenizer is
called missing, and prepare_data.py gsm8k names --input when it finds no data."""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from megarl.data import prepare
from megarl.data.dataset import data_file_problem, read_prompt_files
from megarl.data.prepare import prepare_if_missing, user_data_files


def _data_cfg(train, val=None):
    return SimpleNamespace(auto_prepare="arithmetic", train_files=[str(train)], val_files=[str(val)] if val else [],
                           gsm8k_source=None,
                           arithmetic=SimpleNamespace(kind="copy", num_digits=3, train_size=64, val_size=8))


def test_auto_prepare_never_writes_a_path_given_on_the_command_line(tmp_path):
    typed = tmp_path / "nonexistent" / "x.parquet"
    cfg = _data_cfg(typed)
    user = user_data_files(cfg, ["trainer.total_steps=3", f"data.train_files={typed}"])
    assert user == {str(typed)}
    with pytest.raises(ValueError, match=r"x\.parquet \(given on the command line\) does not exist.*prepare_data\.py"):
        prepare_if_missing(cfg, user)
    assert not (tmp_path / "nonexistent").exists()  # no directory created, nothing trained on


def test_auto_prepare_still_writes_the_config_files_own_paths(tmp_path):
    cfg = _data_cfg(tmp_path / "d" / "train.parquet", tmp_path / "d" / "test.parquet")
    assert user_data_files(cfg, ["trainer.total_steps=3"]) == set()
    assert prepare_if_missing(cfg, set())
    assert len(read_prompt_files([tmp_path / "d" / "train.parquet"])) == 64


def test_a_directory_given_as_a_data_file_is_called_a_directory(tmp_path):
    assert "is a directory" in data_file_problem(str(tmp_path))
    assert data_file_problem(str(tmp_path / "missing.parquet")).startswith("not found")
    with pytest.raises(ValueError, match="is a directory, not a Parquet file"):
        read_prompt_files([str(tmp_path)])


def test_a_missing_tokenizer_is_called_missing(tiny_models, tmp_path):
    from megarl.data.tokenizer import load_tokenizer

    model = tmp_path / "m"
    shutil.copytree(tiny_models["qwen2"], model)
    assert load_tokenizer(str(model)).vocab_size > 0
    for f in model.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ValueError, match=r"model\.path: .* has no tokenizer .*copy the tokenizer files"):
        load_tokenizer(str(model))


def test_prepare_data_gsm8k_without_input_names_the_flag(tmp_path, monkeypatch, capsys):
    from launch.prepare_data import main

    monkeypatch.setattr(prepare, "DEFAULT_GSM8K_DIR", tmp_path / "no-gsm8k-here")
    assert main(["gsm8k", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--input not given" in err and "set --input to a directory" in err and err.count("\n") == 1


def test_prompt_token_ids_beyond_the_models_vocabulary_are_named(tmp_path):
    from megarl.data.dataset import PromptDataset
    from megarl.data.prepare import write_parquet

    write_parquet([{"prompt": "abc", "ground_truth": "1", "data_source": "x"}] * 4, tmp_path / "d.parquet")
    data = PromptDataset([tmp_path / "d.parquet"], prompts_per_step=2, tokenizer=lambda text: [ord(c) for c in text])
    data.check_vocab(100)  # 'a' 'b' 'c' are 97 .. 99
    with pytest.raises(ValueError, match=r"token id 99, but the model has 99 tokens .*tokenizer"):
        data.check_vocab(99)
