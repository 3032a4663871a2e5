"""What megarl reads from a Hugging Face config.json (megarl.models.families), and the
`megarl.tools.logprobs` command line end to end."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import FAMILIES, REPO, torchrun
from megarl.models.families import FAMILIES as SUPPORTED, UnsupportedModelError, check_layout, load_spec, spec_from_hf_config

LLAMA_CONFIG = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=301, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu", rope_theta=10000.0,
)


# --- specs of the tiny models (fixture: one per family, vocabulary 301, llama tied) -------------------


def test_every_tiny_family_is_supported(tiny_models):
    assert set(FAMILIES) == set(SUPPORTED)
    for arch in FAMILIES:
        spec = load_spec(tiny_models[arch])
        assert spec.family == arch
        assert (spec.vocab_size, spec.hidden_size, spec.num_layers) == (301, 64, 2)
        assert (spec.num_heads, spec.num_kv_heads) == (4, 2)
        assert spec.rms_norm_eps == 1e-6 and spec.rope_scaling_factor is None
        assert spec.tie_embeddings == (arch == "llama")


def test_spec_agrees_with_transformers_config(tiny_models):
    from transformers import AutoConfig

    for arch in FAMILIES:
        spec, cfg = load_spec(tiny_models[arch]), AutoConfig.from_pretrained(tiny_models[arch])
        assert spec.architecture == cfg.architectures[0]
        assert spec.num_kv_heads == cfg.num_key_value_heads
        assert spec.head_dim == (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        assert spec.rope_theta == cfg.rope_parameters["rope_theta"]
        assert spec.max_position_embeddings == cfg.max_position_embeddings
        assert spec.tie_embeddings == cfg.tie_word_embeddings


def test_dense_family_details(tiny_models):
    llama, qwen2, qwen3 = (load_spec(tiny_models[a]) for a in ("llama", "qwen2", "qwen3"))
    assert llama.head_dim == 64 // 4 and not llama.qkv_bias and not llama.qk_norm and not llama.is_moe
    assert qwen2.qkv_bias and not qwen2.qk_norm  # Qwen2 always has q/k/v biases
    # Qwen3: head_dim is explicit in config.json (2 * 64 / 4 = 32, not hidden / heads = 16)
    assert qwen3.head_dim == 32 and qwen3.qk_norm and not qwen3.qkv_bias
    for spec in (llama, qwen2, qwen3):
        assert spec.num_experts is None and spec.moe_topk == 0


def test_moe_family_details(tiny_models):
    mixtral, qwen3_moe = load_spec(tiny_models["mixtral"]), load_spec(tiny_models["qwen3_moe"])
    assert mixtral.is_moe and (mixtral.num_experts, mixtral.moe_topk, mixtral.moe_ffn_hidden_size) == (4, 2, 128)
    assert mixtral.moe_renormalize_topk and not mixtral.qk_norm
    assert mixtral.head_dim == 16  # config.json has "head_dim": null
    assert mixtral.rope_theta == 1e6
    names = mixtral.hf_names
    assert (names.moe_block, names.router, names.expert_gate, names.expert_up, names.expert_down) == (
        "block_sparse_moe", "gate", "w1", "w3", "w2")
    assert qwen3_moe.is_moe and (qwen3_moe.num_experts, qwen3_moe.moe_topk, qwen3_moe.moe_ffn_hidden_size) == (4, 2, 64)
    assert qwen3_moe.qk_norm and qwen3_moe.moe_renormalize_topk  # norm_topk_prob: true
    assert qwen3_moe.hf_names.moe_block == "mlp" and qwen3_moe.hf_names.expert_gate == "gate_proj"


def test_qwen3_moe_without_norm_topk_prob():
    cfg = dict(LLAMA_CONFIG, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               norm_topk_prob=False)
    spec = spec_from_hf_config(cfg)
    assert spec.num_experts == 8 and not spec.moe_renormalize_topk


# --- vocabulary padding and layout checks ----------------------------------------------------------------


def test_padded_vocab_size():
    spec = spec_from_hf_config(LLAMA_CONFIG)
    assert [spec.padded_vocab_size(tp) for tp in (1, 2, 4, 8)] == [301, 302, 304, 304]
    # real vocabularies: a multiple of 128 * tp
    qwen = dataclasses.replace(spec, vocab_size=151936)  # 151936 = 128 * 1187
    assert qwen.padded_vocab_size(1) == 151936
    assert qwen.padded_vocab_size(2) == 152064  # 256 * 594
    assert dataclasses.replace(spec, vocab_size=32000).padded_vocab_size(8) == 32768
    assert dataclasses.replace(spec, vocab_size=128256).padded_vocab_size(4) == 128512


def test_check_layout_accepts_valid_layouts(tiny_models):
    for arch in FAMILIES:
        check_layout(load_spec(tiny_models[arch]), tp=2, pp=2)
    check_layout(load_spec(tiny_models["mixtral"]), tp=2, pp=1, ep=4, etp=1)


@pytest.mark.parametrize("change, layout, message", [
    (dict(), dict(tp=8, pp=1), "4 attention heads are not divisible by tp=8"),
    (dict(), dict(tp=4, pp=1), "2 key/value heads are not divisible by tp=4; use a tp that divides 2"),
    (dict(ffn_hidden_size=129), dict(tp=2, pp=1), "ffn hidden size 129 is not divisible by tp=2"),
    (dict(), dict(tp=1, pp=3), "2 layers are not divisible by pp=3"),
    (dict(), dict(tp=1, pp=1, ep=2), "ep=2 needs a mixture-of-experts model; llama is dense"),
])
def test_check_layout_errors(change, layout, message):
    spec = dataclasses.replace(spec_from_hf_config(LLAMA_CONFIG), **change)
    with pytest.raises(ValueError, match=message):
        check_layout(spec, **layout)


def test_check_layout_moe_errors(tiny_models):
    spec = load_spec(tiny_models["qwen3_moe"])  # 4 experts, expert ffn 64
    with pytest.raises(ValueError, match="4 experts are not divisible by ep=3"):
        check_layout(spec, tp=1, pp=1, ep=3)
    with pytest.raises(ValueError, match="expert ffn hidden size 64 is not divisible by etp=3"):
        check_layout(spec, tp=1, pp=1, ep=1, etp=3)


# --- errors for configs megarl cannot run -------------------------------------------------------------------


def test_unknown_model_type_lists_supported_families(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError) as err:
        load_spec(tmp_path)
    message = str(err.value)
    assert "'gpt2'" in message and "GPT2LMHeadModel" in message
    assert "supported families: llama, qwen2, qwen3, mixtral, qwen3_moe" in message
    assert isinstance(err.value, ValueError)


def test_missing_config_json_names_the_path(tmp_path):
    with pytest.raises(UnsupportedModelError, match="is not a Hugging Face model directory") as err:
        load_spec(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


def test_corrupt_config_json_names_the_path(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(UnsupportedModelError, match="is not valid JSON") as err:
        load_spec(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


def test_missing_key_is_named():
    cfg = {k: v for k, v in LLAMA_CONFIG.items() if k != "hidden_size"}
    with pytest.raises(UnsupportedModelError, match="config.json of a llama model lacks the key 'hidden_size'"):
        spec_from_hf_config(cfg)


@pytest.mark.parametrize("change, message", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(attention_bias=True), "attention_bias/mlp_bias"),
    (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0]),
     "mlp_only_layers"),
])
def test_unsupported_variants_are_refused(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        spec_from_hf_config(dict(LLAMA_CONFIG, **change))


def test_sliding_window_attention_is_refused():
    # Megatron's local attention has no sliding window; transformers would apply one.
    qwen2 = dict(LLAMA_CONFIG, model_type="qwen2", sliding_window=4096, max_window_layers=28)
    assert spec_from_hf_config(dict(qwen2, use_sliding_window=False)).family == "qwen2"  # Qwen2.5 as shipped
    with pytest.raises(UnsupportedModelError, match=r"qwen2: sliding-window attention \(sliding_window=4096"):
        spec_from_hf_config(dict(qwen2, use_sliding_window=True))
    with pytest.raises(UnsupportedModelError, match="sliding-window attention"):
        spec_from_hf_config(dict(qwen2, layer_types=["full_attention", "sliding_attention"]))
    mixtral = dict(LLAMA_CONFIG, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    assert spec_from_hf_config(dict(mixtral, sliding_window=None)).family == "mixtral"
    with pytest.raises(UnsupportedModelError, match='set "sliding_window": null'):
        spec_from_hf_config(dict(mixtral, sliding_window=4096))


# --- rope --------------------------------------------------------------------------------------------------------

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)


def test_llama3_rope_scaling_accepted():
    # Llama-3.1 config.json as published: rope_scaling + top-level rope_theta
    spec = spec_from_hf_config(dict(LLAMA_CONFIG, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE))
    assert (spec.rope_theta, spec.rope_scaling_factor) == (500000.0, 8.0)
    # the same as transformers 5 writes it: rope_parameters holding rope_theta
    cfg = {k: v for k, v in LLAMA_CONFIG.items() if k != "rope_theta"}
    spec = spec_from_hf_config(dict(cfg, rope_parameters=dict(LLAMA3_ROPE, factor=32.0, rope_theta=500000.0)))
    assert (spec.rope_theta, spec.rope_scaling_factor) == (500000.0, 32.0)
    assert spec_from_hf_config(dict(LLAMA_CONFIG, rope_scaling={"rope_type": "default"})).rope_scaling_factor is None


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope scaling type 'yarn' is not supported yet; supported: default, llama3"),
    ({"type": "linear", "factor": 2.0}, "rope scaling type 'linear'"),
    (dict(LLAMA3_ROPE, low_freq_factor=2.0), "llama3 rope scaling with low_freq_factor=2.0 is not supported"),
])
def test_unknown_or_unsupported_rope_refused(scaling, message):
    with pytest.raises(UnsupportedModelError, match=message):
        spec_from_hf_config(dict(LLAMA_CONFIG, rope_scaling=scaling))


def test_transformers_written_llama3_config_loads(tmp_path):
    import transformers

    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA_CONFIG.items() if k not in ("model_type", "architectures", "rope_theta")},
                                      rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0))
    config.save_pretrained(tmp_path)
    spec = load_spec(tmp_path)
    assert (spec.rope_theta, spec.rope_scaling_factor) == (500000.0, 8.0)


# --- the logprobs tool ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama3_rope_model(tiny_models, tmp_path_factory):
    """The tiny llama (tied, vocabulary 301) with Llama-3.1 rope scaling: at these lengths the scaling
    moves transformers' log-probs by ~1e-2, so the parity check below also covers it."""
    out = tmp_path_factory.mktemp("llama3_rope")
    shutil.copytree(tiny_models["llama"], out, dirs_exist_ok=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("rope_theta", None)
    cfg["rope_parameters"] = dict(LLAMA3_ROPE, rope_theta=500000.0)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _hf_logprobs(model_dir, sequences: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for seq in sequences:
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0], -1)
            out.append(logp[:-1].gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1))
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_logprobs_cli_tp2_matches_transformers(llama3_rope_model, tmp_path):
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 301, (n,), generator=gen).tolist() for n in (5, 33, 2, 12, 20)]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out" / "lp.jsonl"
    lines = [json.dumps({"input_ids": s}) for s in sequences]
    src.write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")  # blank lines are skipped
    torchrun(2, ["-m", "megarl.tools.logprobs", "--model", str(llama3_rope_model), "--tp", "2",
                 "--input", str(src), "--output", str(dst), "--micro-batch-size", "2"], timeout=300)

    rows = [json.loads(line)["logprobs"] for line in dst.read_text().splitlines()]
    assert len(rows) == len(sequences)
    for seq, row, ref in zip(sequences, rows, _hf_logprobs(llama3_rope_model, sequences)):
        assert len(row) == len(seq) - 1
        assert (torch.tensor(row) - ref).abs().max().item() <= 1e-4


def _run_logprobs(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "megarl.tools.logprobs", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_logprobs_cli_malformed_line(tiny_models, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2\n')
    proc = _run_logprobs("--model", str(tiny_models["llama"]), "--input", str(src), "--output", str(out))
    assert proc.returncode == 2, proc.stderr
    assert f"error: {src}:2: expected a JSON object with an 'input_ids' list" in proc.stderr
    assert not out.exists()


def test_logprobs_cli_bad_model_dir_and_layout(tiny_models, tmp_path, capsys, monkeypatch):
    # In process: main() returns before starting torch.distributed.
    from megarl.tools.logprobs import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    src, out = tmp_path / "in.jsonl", str(tmp_path / "out.jsonl")
    src.write_text('{"input_ids": [1, 2, 3]}\n')
    assert main(["--model", str(tmp_path / "missing"), "--input", str(src), "--output", out]) == 2
    assert f"error: {tmp_path}/missing is not a Hugging Face model directory" in capsys.readouterr().err
    assert main(["--model", str(tiny_models["llama"]), "--tp", "2", "--input", str(src), "--output", out]) == 2
    assert "error: world size 1 is not divisible by tp*pp*cp = 2*1*1 = 2" in capsys.readouterr().err
    assert main(["--model", str(tiny_models["llama"]), "--input", str(tmp_path / "nope.jsonl"), "--output", out]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ('{"input_ids": [4, 5]}\n\n{"input_ids": [7]}\n', ":3: input_ids needs at least 2 tokens"),
    ('{"tokens": [4, 5]}\n', ":1: expected a JSON object with an 'input_ids' list of integers"),
    ('[4, 5]\n', ":1: expected a JSON object"),
    ('{"input_ids": 5}\n', ":1: expected a JSON object"),
    ('{"input_ids": [4, 5.5]}\n', ":1: expected a JSON object"),
    ('{"input_ids": [4, 5]}\n{"input_ids": [4, 301]}\n', ":2: token id 301 is outside the vocabulary \\[0, 301\\)"),
    ('{"input_ids": [-1, 5]}\n', ":1: token id -1 is outside the vocabulary"),
    ('\n\n', " holds no input_ids lines"),
])
def test_read_jsonl_ids_errors(tmp_path, content, message):
    from megarl.tools.logprobs import read_jsonl_ids

    src = tmp_path / "in.jsonl"
    src.write_text(content)
    with pytest.raises(ValueError, match=f"^{src}{message}"):
        read_jsonl_ids(str(src), vocab_size=301)


def test_read_jsonl_ids_reads_lists(tmp_path):
    from megarl.tools.logprobs import read_jsonl_ids

    src = tmp_path / "in.jsonl"
    src.write_text('{"input_ids": [4, 5, 6]}\n\n{"input_ids": [0, 300], "note": "extra keys are fine"}\n')
    assert read_jsonl_ids(str(src), vocab_size=301) == [[4, 5, 6], [0, 300]]
