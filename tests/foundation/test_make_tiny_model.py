"""megarl.tools.make_tiny_model: every family loads with transformers' Auto classes, the tokenizers
behave as documented, weights follow the seed, and --tie ties."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAMILIES, FAMILIES_671B
from megarl.tools.make_tiny_model import ARCHS, DIGITS_ALPHABET, SPECIAL_TOKENS, main, make_tiny_model

SMALL = dict(hidden=16, intermediate=32, layers=1, heads=2, kv_heads=1, experts=2, topk=1)


def test_archs_are_the_test_families():
    assert set(ARCHS) == set(FAMILIES) | set(FAMILIES_671B)


def test_every_arch_loads_with_auto_classes(tiny_models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = "Natalia sold 48 clips; how many in May?"
    for arch in FAMILIES:
        model = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(tiny_models[arch])
        assert model.config.model_type == arch
        assert model.config.vocab_size == 301 >= len(tokenizer)
        # The config's special token ids are the tokenizer's.
        assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (
            tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text  # byte-level BPE: any text round-trips
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits
        assert logits.shape == (1, len(ids), 301) and torch.isfinite(logits).all()


def test_digits_tokenizer_one_token_per_character(tmp_path):
    from transformers import AutoTokenizer

    make_tiny_model("llama", tmp_path, tokenizer="digits", **SMALL)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(DIGITS_ALPHABET)
    text = "12+34=46; 7*8-9=47? #0 :"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.convert_ids_to_tokens(ids) == list(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer("x")["input_ids"] == [tokenizer.unk_token_id]  # outside the alphabet
    assert tokenizer.decode([tokenizer.bos_token_id, *ids, tokenizer.eos_token_id], skip_special_tokens=True) == text
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer)  # default: the tokenizer's size


def _weights(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def test_seed_decides_the_weights(tmp_path):
    a = make_tiny_model("qwen3_moe", tmp_path / "a", seed=3, tokenizer="digits", **SMALL)
    b = make_tiny_model("qwen3_moe", tmp_path / "b", seed=3, tokenizer="digits", **SMALL)
    c = make_tiny_model("qwen3_moe", tmp_path / "c", seed=4, tokenizer="digits", **SMALL)
    wa, wb, wc = _weights(a), _weights(b), _weights(c)
    assert wa.keys() == wb.keys() == wc.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    matrices = [k for k in wa if wa[k].dim() > 1]
    assert matrices and all(not torch.equal(wa[k], wc[k]) for k in matrices)
    # init_std (0.1) rather than transformers' tiny initializer_range
    assert 0.05 < wa["model.embed_tokens.weight"].std().item() < 0.2


def test_tie_flag_ties_embeddings(tmp_path):
    from transformers import AutoModelForCausalLM

    flags = ["--tokenizer", "digits", "--hidden", "16", "--intermediate", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1"]
    main(["--arch", "qwen2", "--out", str(tmp_path / "tied"), "--tie", *flags])
    main(["--arch", "qwen2", "--out", str(tmp_path / "untied"), *flags])

    tied = AutoModelForCausalLM.from_pretrained(tmp_path / "tied")
    assert tied.config.tie_word_embeddings
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" not in _weights(tmp_path / "tied")

    untied = AutoModelForCausalLM.from_pretrained(tmp_path / "untied")
    assert not untied.config.tie_word_embeddings
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)
    assert "lm_head.weight" in _weights(tmp_path / "untied")
    recorded = json.loads((tmp_path / "tied" / "megarl_tiny.json").read_text())
    assert recorded["tie"] is True and recorded["arch"] == "qwen2"


def test_bad_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="smaller than the tokenizer's 23 tokens"):
        make_tiny_model("llama", tmp_path / "small", tokenizer="digits", vocab_size=10, **SMALL)
    with pytest.raises(ValueError, match="make_tiny_model has no option 'hiden'"):
        make_tiny_model("llama", tmp_path / "typo", hiden=16)
    with pytest.raises(SystemExit):
        main(["--arch", "gpt2", "--out", str(tmp_path / "gpt2")])
