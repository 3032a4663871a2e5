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

from conftest import FAMILIES, FAMILIES_671B, REPO, torchrun
from megarl.layout import ModelShape, ParallelLayout, check_model
from megarl.models.families import FAMILIES as SUPPORTED, UnsupportedModelError, load_spec, spec_from_hf_config

LLAMA_CONFIG = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=301, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu", rope_theta=10000.0,
)


# --- specs of the tiny models (fixture: one per family, vocabulary 301, llama tied) -------------------


def test_every_tiny_family_is_supported(tiny_models):
    assert set(FAMILIES) | set(FAMILIES_671B) == set(SUPPORTED)
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


def check_layout(spec, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    """megarl.layout's model rules for `spec` (dp chosen so that every expert split divides)."""
    check_model(ModelShape.of_spec(spec), ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, dp=(etp or tp) * ep))


def test_check_layout_accepts_valid_layouts(tiny_models):
    for arch in FAMILIES:
        check_layout(load_spec(tiny_models[arch]), tp=2, pp=2)
    check_layout(load_spec(tiny_models["mixtral"]), tp=2, pp=1, ep=4, etp=1)


@pytest.mark.parametrize("change, layout, message", [
    (dict(), dict(tp=8, pp=1), "parallel.tp = 8 does not divide the model's 4 attention heads"),
    (dict(), dict(tp=4, pp=1), "parallel.tp = 4 does not divide the model's 2 key/value heads"),
    (dict(ffn_hidden_size=129), dict(tp=2, pp=1), "parallel.tp = 2 does not divide the model's 129 ffn width"),
    (dict(), dict(tp=1, pp=3), "2 layers do not split over pp=3"),
    (dict(), dict(tp=1, pp=1, ep=2), "parallel.ep = 2 needs a mixture-of-experts model; this llama model is dense"),
])
def test_check_layout_errors(change, layout, message):
    spec = dataclasses.replace(spec_from_hf_config(LLAMA_CONFIG), **change)
    with pytest.raises(ValueError, match=message):
        check_layout(spec, **layout)


def test_check_layout_moe_errors(tiny_models):
    spec = load_spec(tiny_models["qwen3_moe"])  # 4 experts, expert ffn 64
    with pytest.raises(ValueError, match="parallel.ep = 3 does not divide the model's 4 routed experts"):
        check_layout(spec, tp=1, pp=1, ep=3)
    with pytest.raises(ValueError, match="parallel.etp = 3 does not divide the model's 64 expert ffn width"):
        check_layout(spec, tp=1, pp=1, ep=1, etp=3)


# --- errors for configs megarl cannot run -------------------------------------------------------------------


def test_unknown_model_type_lists_supported_families(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError) as err:
        load_spec(tmp_path)
    message = str(err.value)
    assert "'gpt2'" in message and "GPT2LMHeadModel" in message
    assert "supported families: llama, qwen2, qwen3, mixtral, qwen3_moe, deepseek_v3, glm4_moe" in message
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


# --- DeepSeek-V3 / Kimi-K2 and GLM-4.5 (issue 14) ------------------------------------------------------

DSV3_CONFIG = dict(
    LLAMA_CONFIG, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], num_key_value_heads=4,
    rms_norm_eps=1e-6, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2, n_group=2, topk_group=1,
    first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=1,
)


def test_deepseek_v3_and_glm4_moe_specs(tiny_moe_671b_models):
    from transformers import AutoConfig

    for name, path in tiny_moe_671b_models.items():
        spec, cfg = load_spec(path), AutoConfig.from_pretrained(path)
        assert spec.family == cfg.model_type and spec.architecture == cfg.architectures[0]
        assert (spec.num_experts, spec.moe_topk, spec.moe_ffn_hidden_size) == (8, cfg.num_experts_per_tok, 64)
        assert spec.moe_score_function == "sigmoid" and spec.moe_expert_bias and spec.moe_renormalize_topk
        assert spec.moe_routed_scaling_factor == 2.5 and spec.moe_shared_ffn_hidden_size == 64
        assert spec.moe_first_dense_layers == 1 and spec.moe_layer_pattern == [0, 1, 1, 1]
        assert [spec.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
        # one group, or every group chosen, is plain top-k; else Megatron's group-limited routing
        groups = None if cfg.n_group == 1 else (cfg.n_group, cfg.topk_group)
        assert (None if spec.moe_num_groups is None else (spec.moe_num_groups, spec.moe_group_topk)) == groups
        assert spec.tie_embeddings == name.endswith("_tied")
        assert spec.mtp_layers == cfg.num_nextn_predict_layers
    dsv3, noq = load_spec(tiny_moe_671b_models["deepseek_v3"]), load_spec(tiny_moe_671b_models["deepseek_v3_noq_tied"])
    assert dsv3.attention == "mla" and dsv3.mla.q_lora_rank == 32 and noq.mla.q_lora_rank is None
    assert (dsv3.mla.kv_lora_rank, dsv3.mla.qk_nope_head_dim, dsv3.mla.qk_rope_head_dim, dsv3.mla.v_head_dim) == (32, 16, 8, 20)
    assert dsv3.yarn is not None and dsv3.yarn.factor == 4.0 and noq.yarn is None
    glm, glm_tied = load_spec(tiny_moe_671b_models["glm4_moe"]), load_spec(tiny_moe_671b_models["glm4_moe_tied"])
    assert glm.attention == "gqa" and glm.rotary_percent == 0.5 and glm.qkv_bias
    assert glm.qk_norm and not glm_tied.qk_norm


# transformers' YaRN (rope_parameters as in config.json) -> what the cos/sin and the softmax get
YARN_CASES = [
    dict(factor=40.0, mscale=1.0, mscale_all_dim=1.0),  # DeepSeek-V3 / Kimi-K2
    dict(factor=40.0, mscale=0.707, mscale_all_dim=0.707),
    dict(factor=8.0),  # neither mscale: attention factor 0.1 ln f + 1, softmax unscaled
    dict(factor=8.0, mscale=0.5),  # mscale alone is ignored by transformers
    dict(factor=8.0, mscale_all_dim=1.0),  # softmax scaled, cos/sin by 0.1 ln f + 1
    dict(factor=16.0, attention_factor=1.3, mscale=1.0, mscale_all_dim=0.8),  # explicit factor wins
    dict(factor=4.0, beta_fast=16, beta_slow=2, mscale=1.0, mscale_all_dim=1.0),
]


@pytest.mark.parametrize("yarn", YARN_CASES)
def test_yarn_matches_transformers(yarn):
    """The inverse frequencies, the cos/sin factor and the softmax scale Megatron-Core's MLA gets
    from our spec equal the ones transformers computes for the same config.json."""
    import math

    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
        _yarn_get_concentration_factor,
        _yarn_get_mscale,
    )
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from megarl.platform import current_platform

    current_platform()  # on CPU, the seams: YarnRotaryEmbedding moves its tensors to current_device()
    rope = dict(rope_type="yarn", rope_theta=10000.0, original_max_position_embeddings=64, **yarn)
    cfg = dict(DSV3_CONFIG, max_position_embeddings=2560, rope_parameters=rope)
    hf_config = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    hf_inv_freq, hf_attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    q_head_dim = 16 + 8
    hf_softmax_scale = yarn_apply_mscale(hf_config.rope_parameters, q_head_dim ** -0.5)

    y = spec_from_hf_config(cfg).yarn
    megatron = YarnRotaryEmbedding(8, rotary_base=10000.0, use_cpu_initialization=True, scaling_factor=y.factor,
                                   original_max_position_embeddings=y.original_max_position_embeddings,
                                   beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim)
    emb, concentration = megatron.get_emb(2)
    assert torch.equal(emb[1, 0, 0, :4], hf_inv_freq)  # position 1: the inverse frequencies themselves
    assert concentration == pytest.approx(hf_attention_factor, rel=1e-12)
    assert concentration == _yarn_get_concentration_factor(y.factor, y.mscale, y.mscale_all_dim)
    # MultiLatentAttention.__init__: mscale(factor, mscale_all_dim)^2 / sqrt(q_head_dim)
    megatron_softmax_scale = _yarn_get_mscale(y.factor, y.mscale_all_dim) ** 2 / math.sqrt(q_head_dim)
    assert megatron_softmax_scale == pytest.approx(hf_softmax_scale, rel=1e-12)


@pytest.mark.parametrize("change, message", [
    (dict(norm_topk_prob=False), "norm_topk_prob=false is not supported"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=4), r"num_experts_per_tok=4 is more than the 1 chosen groups"),
    (dict(n_group=3), "8 routed experts do not split into n_group=3 groups"),
    (dict(first_k_dense_replace=2), "first_k_dense_replace=2 leaves no MoE layer"),
    (dict(rope_interleave=False), "rope_interleave=false is not supported"),
    (dict(attention_bias=True), "attention_bias=true is not supported"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 must equal num_attention_heads=4"),
    (dict(rms_norm_eps=1e-5), r"rms_norm_eps=1e-05 is not supported \(only 1e-6"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=64,
                               truncate=False)), "yarn with truncate=false is not supported"),
    (dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=4.0)), "rope scaling type 'linear' is not supported"),
])
def test_deepseek_v3_configs_megarl_cannot_match_are_refused(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        spec_from_hf_config(dict(DSV3_CONFIG, **change))


def test_deepseek_v3_spec_from_config_json():
    spec = spec_from_hf_config(DSV3_CONFIG)
    assert spec.moe_shared_ffn_hidden_size == 2 * 32  # n_shared_experts * moe_intermediate_size
    assert spec.head_dim == 16 + 8 and spec.num_kv_heads == 4
    # an older config.json: rope_theta and rope_scaling {"type": "yarn"} (DeepSeek-V3's own file)
    old = dict(DSV3_CONFIG, rope_theta=5e4, rope_scaling=dict(type="yarn", factor=40, mscale=1.0, mscale_all_dim=1.0,
                                                               original_max_position_embeddings=4096, beta_fast=32, beta_slow=1))
    spec = spec_from_hf_config(old)
    assert spec.rope_theta == 5e4 and spec.yarn.factor == 40 and spec.yarn.mscale == 1.0 == spec.yarn.mscale_all_dim
    # all groups chosen (topk_group == n_group) is plain top-k
    assert spec_from_hf_config(dict(DSV3_CONFIG, n_group=4, topk_group=4)).moe_num_groups is None


def test_glm4_moe_partial_rotary_must_give_even_dims():
    glm = dict(DSV3_CONFIG, model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], head_dim=16,
               rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5))
    assert spec_from_hf_config(glm).rotary_percent == 0.5
    glm["rope_parameters"] = dict(glm["rope_parameters"], partial_rotary_factor=0.3)
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor=0.3 of head_dim=10 gives 3 rotary dims"):
        spec_from_hf_config(dict(glm, head_dim=10))


def test_check_layout_mla(tiny_moe_671b_models):
    spec = load_spec(tiny_moe_671b_models["deepseek_v3"])
    check_layout(spec, tp=2, pp=2, ep=2)
    with pytest.raises(ValueError, match=r"parallel.tp = 2 does not divide the model's 41 MLA key/value latent rows \(kv_lora_rank \+ qk_rope_head_dim\)"):
        check_layout(dataclasses.replace(spec, mla=dataclasses.replace(spec.mla, kv_lora_rank=33)), tp=2, pp=1)
    with pytest.raises(ValueError, match=r"parallel.tp = 4 does not divide the model's 30 MLA query latent rows \(q_lora_rank\)"):
        check_layout(dataclasses.replace(spec, mla=dataclasses.replace(spec.mla, q_lora_rank=30)), tp=4, pp=1)


# DeepSeek-V3's and GLM-4.5's published config.json (the keys megarl reads, values as released)
DEEPSEEK_V3_RELEASED = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                          "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "vocab_size": 129280, "num_nextn_predict_layers": 1, "attention_bias": False,
}
GLM45_RELEASED = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 5120, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8,
    "head_dim": 128, "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": True, "n_routed_experts": 160,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "num_nextn_predict_layers": 1, "vocab_size": 151552,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 1000000, "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def test_released_configs_build_megatron_configs_at_published_layouts():
    """The real config.json files load, and Megatron-Core accepts the TransformerConfig megarl builds
    from them at the recipes' layouts (NeMo-RL's DeepSeek-V3 TP1 PP16 EP16 with 3 / 2 end stages,
    verl's TP8 PP12 EP8; Megatron-Bridge's GLM-4.5 TP2 PP8 EP16 ETP1 with uneven ends)."""
    from megarl.models.builder import build_transformer_config
    from megarl.distributed.parallel import ParallelDims

    dsv3 = spec_from_hf_config(DEEPSEEK_V3_RELEASED)
    assert (dsv3.moe_num_groups, dsv3.moe_group_topk, dsv3.moe_routed_scaling_factor) == (8, 4, 2.5)
    assert dsv3.yarn == dataclasses.replace(dsv3.yarn, factor=40.0, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
                                            original_max_position_embeddings=4096)
    assert dsv3.mla.q_lora_rank == 1536 and dsv3.moe_first_dense_layers == 3 and dsv3.mtp_layers == 1
    for dims in (ParallelDims(world_size=256, pp=16, ep=16, first_stage_layers=3, last_stage_layers=2),
                 ParallelDims(world_size=768, tp=8, pp=12, ep=8, last_stage_layers=6)):
        config = build_transformer_config(dsv3, dims)
        assert type(config).__name__ == "MLATransformerConfig" and config.rope_type == "yarn"
        assert (config.moe_router_num_groups, config.moe_router_group_topk, config.moe_router_score_function) == (8, 4, "sigmoid")
        assert config.moe_layer_freq == [0] * 3 + [1] * 58 and config.moe_shared_expert_intermediate_size == 2048
        assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 0.0
    glm = spec_from_hf_config(GLM45_RELEASED)
    assert glm.rotary_percent == 0.5 and glm.qk_norm and glm.qkv_bias and glm.moe_num_groups is None
    config = build_transformer_config(glm, ParallelDims(world_size=256, tp=2, pp=8, ep=16, etp=1, first_stage_layers=11,
                                                       last_stage_layers=9))
    assert config.moe_layer_freq == [0] * 3 + [1] * 89 and config.moe_router_topk_scaling_factor == 2.5


@pytest.mark.parametrize("experts, groups, topk_group, topk", [
    (8, 2, 1, 2),    # DeepSeek-V3's ratio: top-k / topk_group = 2, where Megatron's own rule agrees
    (8, 4, 2, 2),    # ratio 1: Megatron alone would rank groups by their single best expert
    (8, 2, 1, 4),    # ratio 4
    (16, 4, 3, 3),
    (256, 8, 4, 8),  # DeepSeek-V3 / Kimi-K2 sizes
])
def test_group_limited_routing_matches_transformers(experts, groups, topk_group, topk):
    """Megatron's router (with megarl's group scoring) picks the experts and weights transformers'
    DeepseekV3TopkRouter picks, for group ratios Megatron's own rule gets wrong."""
    from megatron.core.transformer.moe import moe_utils
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from megarl.models.moe_routing import use_hf_group_limited_topk

    use_hf_group_limited_topk()
    cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=experts, num_experts_per_tok=topk, n_group=groups,
                           topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(experts * 100 + groups * 10 + topk)
    router.weight.data = torch.randn(experts, 16, generator=gen)
    router.e_score_correction_bias.data = 0.3 * torch.randn(experts, generator=gen)
    hidden = torch.randn(64, 16, generator=gen)
    logits, hf_weights, hf_indices = router(hidden)
    probs, routing_map = moe_utils.topk_routing_with_score_function(
        logits, topk, num_groups=groups, group_topk=topk_group, scaling_factor=2.5, score_function="sigmoid",
        expert_bias=router.e_score_correction_bias)
    hf_map = torch.zeros_like(routing_map).scatter_(1, hf_indices, True)
    assert torch.equal(routing_map, hf_map)
    hf_probs = torch.zeros_like(probs).scatter_(1, hf_indices, hf_weights)
    torch.testing.assert_close(probs, hf_probs, rtol=1e-6, atol=1e-7)
