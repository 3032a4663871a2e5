"""The direct weight path into vLLM without vLLM: the converter turns a rollout shard of a
canonical Megatron tensor into exactly the slice vLLM's own loaders cut from the HF tensors
(QKVParallelLinear: this rank's q heads, then its kv heads; MergedColumnParallelLinear: its gate
rows, then its up rows; VocabParallelEmbedding: its rows of the vocabulary padded to 64), and the
applicability check names why a model falls back. The real engine runs it in tests/vllm."""
from __future__ import annotations

import pytest
import torch

from megarl.models.convert import weight_mappings
from megarl.models.families import spec_from_hf_config
from megarl.models.sharding import ShardMeta
from megarl.rollout.vllm_direct import direct_problem, direct_targets, make_converter, vocab_rows

CFG = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=1,
           num_attention_heads=8, num_key_value_heads=4, vocab_size=150, max_position_embeddings=64, rms_norm_eps=1e-6,
           rope_theta=10000.0, tie_word_embeddings=False)


def _hf(spec):
    g = torch.Generator().manual_seed(0)
    d, h = spec.head_dim, spec.hidden_size
    shapes = {"q_proj.weight": (spec.num_heads * d, h), "k_proj.weight": (spec.num_kv_heads * d, h),
              "v_proj.weight": (spec.num_kv_heads * d, h), "q_proj.bias": (spec.num_heads * d,),
              "k_proj.bias": (spec.num_kv_heads * d,), "v_proj.bias": (spec.num_kv_heads * d,)}
    hf = {f"model.layers.0.self_attn.{k}": torch.randn(s, generator=g) for k, s in shapes.items()}
    hf["model.layers.0.mlp.gate_proj.weight"] = torch.randn(spec.ffn_hidden_size, h, generator=g)
    hf["model.layers.0.mlp.up_proj.weight"] = torch.randn(spec.ffn_hidden_size, h, generator=g)
    hf["model.embed_tokens.weight"] = torch.randn(spec.vocab_size, h, generator=g)
    return hf


def _canonical(mapping, hf):
    rows = [hf[p.hf_name].narrow(0, p.hf_row_start, p.rows) if p.hf_name else torch.zeros(p.rows, *mapping.shape[1:])
            for p in mapping.pieces]
    return torch.cat(rows)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_converted_shards_are_what_vllm_slices_from_the_hf_tensors(tp):
    spec = spec_from_hf_config(CFG)
    hf = _hf(spec)
    maps = {m.name: m for m in weight_mappings(spec, 2)}  # the trainer's own padding (train tp 2)
    org_padded = 192  # vLLM pads 150 rows to a multiple of 64
    convert = make_converter(spec, tp, org_padded)
    d, heads, kv, f = spec.head_dim, spec.num_heads // tp, spec.num_kv_heads // tp, spec.ffn_hidden_size // tp
    for q in range(tp):
        for suffix in ("weight", "bias"):
            m = maps[f"decoder.layers.0.self_attention.linear_qkv.{suffix}"]
            shard = ShardMeta(m.shape, 0, 0, 1).slice_of_full(_canonical(m, hf), q, tp)
            [(name, got)] = convert(m.name, shard)
            p = f"model.layers.0.self_attn.{{}}.{suffix}"
            want = torch.cat([hf[p.format("q_proj")][q * heads * d:(q + 1) * heads * d],
                              hf[p.format("k_proj")][q * kv * d:(q + 1) * kv * d], hf[p.format("v_proj")][q * kv * d:(q + 1) * kv * d]])
            assert name == f"model.layers.0.self_attn.qkv_proj.{suffix}" and torch.equal(got, want), (q, suffix)
        m = maps["decoder.layers.0.mlp.linear_fc1.weight"]
        shard = ShardMeta(m.shape, 0, 0, 1, 2).slice_of_full(_canonical(m, hf), q, tp)
        [(name, got)] = convert(m.name, shard)
        gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
        assert name == "model.layers.0.mlp.gate_up_proj.weight"
        assert torch.equal(got, torch.cat([gate[q * f:(q + 1) * f], up[q * f:(q + 1) * f]]))
        # the vocabulary: vLLM's rows of the real 150, then zero padding up to 192 / tp rows
        lo, hi = vocab_rows(spec.vocab_size, org_padded, tp)[q]
        embedding = _canonical(maps["embedding.word_embeddings.weight"], hf)
        [(name, got)] = convert("embedding.word_embeddings.weight", embedding[lo:hi])
        assert name == "model.embed_tokens.weight" and got.shape == (org_padded // tp, spec.hidden_size)
        assert torch.equal(got[:hi - lo], hf["model.embed_tokens.weight"][lo:hi]) and not got[hi - lo:].any()
    assert vocab_rows(150, 192, 4) == ((0, 48), (48, 96), (96, 144), (144, 150))
    assert vocab_rows(23, 64, 2) == ((0, 23), (23, 23))  # a rank may hold padding only


def _description(spec, tp, rank, **changes):
    targets = direct_targets(spec, tp, 192)
    desc = dict(model_class="Qwen2ForCausalLM", tp_rank=rank % tp, tp_size=tp, params={t.param: t.shape for t in targets.values()},
                quant={"model.layers.0.self_attn.qkv_proj": "UnquantizedLinearMethod", "lm_head": "UnquantizedEmbeddingMethod"},
                vocab=dict(org_padded=192, padded=192, rows=vocab_rows(spec.vocab_size, 192, tp)[rank % tp]))
    desc.update(changes)
    return desc


def test_the_direct_path_applies_only_to_what_it_covers():
    spec = spec_from_hf_config(CFG)
    assert direct_problem(spec, 2, 3, _description(spec, 2, 3)) is None
    assert "TP rank 0 of 2, not 1 of 2" in direct_problem(spec, 2, 1, _description(spec, 2, 0))
    assert "replicates kv heads" in direct_problem(spec, 8, 0, _description(spec, 2, 0, tp_size=8, tp_rank=0))
    quantized = _description(spec, 2, 0, quant={"model.layers.0.mlp.down_proj": "Fp8LinearMethod"})
    assert "Fp8LinearMethod at model.layers.0.mlp.down_proj" in direct_problem(spec, 2, 0, quantized)
    extra = _description(spec, 2, 0)
    extra["params"]["model.layers.0.self_attn.o_proj.bias"] = (64,)  # a layout the table does not know
    assert "model.layers.0.self_attn.o_proj.bias" in direct_problem(spec, 2, 0, extra)
    lora = _description(spec, 2, 0, vocab=dict(org_padded=192, padded=256, rows=(0, 96)))
    assert "added (LoRA) vocabulary" in direct_problem(spec, 2, 0, lora)
    moe = spec_from_hf_config(dict(CFG, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8))
    assert "qwen3_moe family" in direct_problem(moe, 2, 0, _description(spec, 2, 0))
