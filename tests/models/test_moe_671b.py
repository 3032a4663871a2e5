"""DeepSeek-V3 / GLM-4.5 details the parity runs do not show on their own: the score-correction bias
is a float32 buffer that training never moves, multi-token-prediction layers are skipped with one
note, Transformer-Engine's fused MLA norm names map onto the same weights as the local ones, and
MLA's latent-norm gradients are complete on every TP rank."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from conftest import torchrun


def _routers(model):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def test_correction_bias_is_loaded_frozen_and_never_updated(world_of_one, tiny_moe_671b_models):
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    from megarl.models import load_model

    path = tiny_moe_671b_models["deepseek_v3"]
    tensors = load_file(path / "model.safetensors")
    checkpoint = [tensors[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in (1, 2, 3)]
    model, spec = load_model(str(path), world_of_one)
    routers = _routers(model)  # layer 0 is dense: three MoE layers, three routers
    assert len(routers) == 3
    for router, bias in zip(routers, checkpoint):
        assert router.expert_bias.dtype == torch.float32 and torch.equal(router.expert_bias, bias)
    assert "expert_bias" not in {n.rsplit(".", 1)[-1] for n, _ in model.named_parameters()}  # no optimizer touches it
    assert model.config.moe_router_enable_expert_bias and model.config.moe_router_bias_update_rate == 0.0

    # A training forward counts tokens per expert; the step's bias update (finalize_model_grads) then
    # runs with rate 0 and leaves the checkpoint's bias as it was.
    model.train()
    tokens = torch.randint(0, spec.vocab_size, (2, 12))
    positions = torch.arange(12).unsqueeze(0).expand(2, -1)
    model(tokens, positions, None).sum().backward()
    counts = [router.local_tokens_per_expert.clone() for router in routers]
    for c in counts:
        assert c.sum() == 2 * 12 * spec.moe_topk and (c != c.mean()).any()  # unbalanced: a real update would move it
    _update_router_expert_bias([model], model.config)
    for router, bias, c in zip(routers, checkpoint, counts):
        assert torch.equal(router.expert_bias, bias)
        # the same update at Megatron's default rate would have changed it
        assert not torch.equal(get_updated_expert_bias(c, bias.clone(), 1e-3), bias)


def test_mtp_layers_are_skipped_with_one_note(world_of_one, tiny_moe_671b_models, caplog):
    from megarl.models import load_model

    with caplog.at_level(logging.WARNING, logger="megarl.models.weights"):
        load_model(str(tiny_moe_671b_models["glm4_moe"]), world_of_one)
    notes = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(notes) == 1 and "skipping 1 multi-token-prediction layer(s)" in notes[0] and "model.layers.4" in notes[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megarl.models.weights"):
        load_model(str(tiny_moe_671b_models["glm4_moe_tied"]), world_of_one)  # no MTP layers: no note
    assert not [r for r in caplog.records if "multi-token-prediction" in r.getMessage()]


def test_te_fused_mla_norms_map_to_the_local_names(tiny_moe_671b_models):
    from megarl.models.convert import weight_mappings
    from megarl.models.families import load_spec
    from megarl.models.weights import global_name

    names = {m.name for m in weight_mappings(load_spec(tiny_moe_671b_models["deepseek_v3"]), tp=2)}
    for te, local in (("self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.q_layernorm.weight"),
                      ("self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.kv_layernorm.weight"),
                      ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")):
        assert global_name(f"decoder.layers.0.{te}", 1, 0) == f"decoder.layers.1.{local}"
        assert f"decoder.layers.1.{local}" in names
    assert "decoder.layers.1.mlp.router.expert_bias" in names and "decoder.layers.0.mlp.router.expert_bias" not in names


@pytest.mark.multiprocess
def test_mla_latent_norm_grads_need_no_tp_reduction(tiny_moe_671b_models, tmp_path):
    """At tp2 each rank's q/kv latent-norm gradient already equals tp1's; finalize_model_grads sums
    `q_layernorm` grads over TP when config.qk_layernorm is set, so the built model must leave it
    off (builder._mla_latent_norms_at_build; Megatron-Core 0.19 needs it on while building). At
    tp2 with sequence parallelism the grads are per-rank shares, tagged, and their TP sum is tp1's.
    Then one actor train step at tp2 with sequence parallelism equals one process's, the RoPE key rows
    of kv_a_proj_with_mqa included (their gradient summed over TP: mla_sequence_sharded_kv)."""
    out = tmp_path / "grads.json"
    torchrun(2, ["tests/models/mla_grad_worker.py", "--model", str(tiny_moe_671b_models["deepseek_v3"]), "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["qk_layernorm"] is False
    assert result["norms"] == ["decoder.layers.0.self_attention.kv_layernorm.weight",
                               "decoder.layers.0.self_attention.q_layernorm.weight"]
    assert result["max_rel_diff"] < 1e-5, result  # summing over the two TP ranks would make it 1
    # with sequence parallelism each rank holds its tokens' share, summed over TP by the tag (once)
    assert result["sp_tagged"] is True and result["sp_max_rel_diff"] < 1e-5, result
    updated = result["update"]
    assert updated["kv_a"] == 4 and len(updated["grad_norms"][0]) == 1, updated  # every layer, one optimizer step
    assert updated["grad_norm_rel"] < 1e-5, updated  # 2e-3 with the RoPE key's gradient not summed over TP
    assert updated["weights_rel"] < 1e-5 and updated["rope_key_rel"] < 1e-5, updated
