"""megarl.models.sequence_parallel and the pieces of sequence parallelism that need no process group:
the norm Megatron's local spec lacks, its place in the layer specs, the routes of one TP rank's
tokens, padded widths a multiple of tp. (Multi-process: tests/models/test_parity*.py,
tests/engine/test_engine.py, tests/moe, tests/trainer/test_ppo_runs.py.)"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megarl.engine.micro_batches import plan_padded
from megarl.models.moe_routing import micro_batch_routes, sequence_parallel_shard
from megarl.models.sequence_parallel import SequenceParallelNorm, local_norms, sequence_multiple


def _config(sequence_parallel: bool, normalization: str = "RMSNorm"):
    # the fields the local norms read (a TransformerConfig refuses sequence_parallel at tp 1)
    return SimpleNamespace(normalization=normalization, sequence_parallel=sequence_parallel, layernorm_zero_centered_gamma=False,
                           memory_efficient_layer_norm=False, persist_layer_norm=False)


def test_norm_is_torchs_and_tagged_for_the_tp_sum():
    for sp in (True, False):
        norm = SequenceParallelNorm(config=_config(sp), hidden_size=6, eps=1e-6)
        assert type(norm) is torch.nn.RMSNorm and norm.eps == 1e-6 and torch.equal(norm.weight, torch.ones(6))
        assert norm.weight.sequence_parallel is sp
    layer_norm = SequenceParallelNorm(config=_config(True, "LayerNorm"), hidden_size=4)
    assert type(layer_norm) is torch.nn.LayerNorm and layer_norm.bias.sequence_parallel is True
    with pytest.raises(ValueError, match="only RMSNorm, LayerNorm"):
        SequenceParallelNorm(config=_config(True, "L2Norm"), hidden_size=4)


def test_megatrons_local_norm_still_refuses_sequence_parallelism():
    # Why SequenceParallelNorm exists (Megatron-LM#1448): when this stops raising, the local spec's
    # own norm can take over again.
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        WrappedTorchNorm(config=_config(True), hidden_size=4)


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_local_specs_get_the_norm_everywhere(arch, tmp_path):
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from conftest import make_model
    from megarl.models.builder import layer_spec
    from megarl.models.families import load_spec

    spec = load_spec(make_model(tmp_path / arch, arch, vocab_size=301))
    layer = layer_spec(spec, use_te=False).submodules
    attention = layer.self_attention.submodules
    names = ("q_layernorm", "k_layernorm") if arch == "qwen3" else ("q_layernorm", "kv_layernorm")  # per-head / MLA latents
    assert layer.input_layernorm is SequenceParallelNorm
    assert all(getattr(attention, n) is SequenceParallelNorm for n in names)
    assert layer.pre_mlp_layernorm in (SequenceParallelNorm, IdentityOp)  # dense local layers fuse it
    assert WrappedTorchNorm not in vars(layer).values() and WrappedTorchNorm not in vars(attention).values()
    assert local_norms(layer_spec(spec, use_te=False)).submodules.input_layernorm is SequenceParallelNorm


def test_each_tp_rank_replays_the_routes_of_its_own_tokens():
    # A padded micro-batch of 2 rows x 4 tokens, 1 layer, top-1: token t of row i routes to expert
    # 10 * i + t. The router sees [s, b] flattened s-major; under sequence parallelism TP rank r
    # holds positions [2r, 2r + 2) of both rows.
    mb = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "rows": [0, 1]}
    routes = [torch.tensor([[[10 * i + t]] for t in range(4)], dtype=torch.int16) for i in range(2)]
    full = micro_batch_routes(mb, routes, [4, 4], num_layers=1, topk=1)
    assert full[:, 0, 0].tolist() == [0, 10, 1, 11, 2, 12, 3, 13]
    assert sequence_parallel_shard(full, 0, 2)[:, 0, 0].tolist() == [0, 10, 1, 11]
    assert sequence_parallel_shard(full, 1, 2)[:, 0, 0].tolist() == [2, 12, 3, 13]
    with pytest.raises(ValueError, match="8 router tokens do not split over 3 sequence-parallel ranks"):
        sequence_parallel_shard(full, 0, 3)


def test_padded_width_divides_by_tp_under_sequence_parallelism():
    def alone(values):
        return values

    assert plan_padded([9, 7, 5], budget=20, agree_max=alone).width == 9
    assert plan_padded([9, 7, 5], budget=20, agree_max=alone, multiple=2).width == 10
    assert plan_padded([9, 7, 5], budget=20, agree_max=alone, multiple=4).width == 12
    assert sequence_multiple(SimpleNamespace(tp=4, sequence_parallel=True)) == 4
    assert sequence_multiple(SimpleNamespace(tp=4, sequence_parallel=False)) == 1


def test_mla_kv_down_projection_is_hooked_only_where_its_rope_key_gradient_needs_the_tp_sum():
    # The multi-process check (the gradients of one train step at tp2 with SP against one process)
    # is tests/models/test_moe_671b.py::test_mla_latent_norm_grads_need_no_tp_reduction.
    from megarl.models.sequence_parallel import mla_sequence_sharded_kv

    def model(rows: int):
        attention = torch.nn.Module()
        attention.linear_kv_down_proj = torch.nn.Linear(6, rows, bias=False)  # weight [rows, 6]
        layer = torch.nn.Module()
        layer.self_attention = attention
        return torch.nn.ModuleDict({"layer": layer})

    def config(sp=True, tp=2, mla=True):
        return SimpleNamespace(multi_latent_attention=mla, sequence_parallel=sp, tensor_model_parallel_size=tp,
                               kv_lora_rank=8, qk_pos_emb_head_dim=4)

    assert mla_sequence_sharded_kv(model(6), config(sp=False)) == 0
    assert mla_sequence_sharded_kv(model(6), config(tp=1)) == 0
    assert mla_sequence_sharded_kv(model(6), config(mla=False)) == 0
    assert mla_sequence_sharded_kv(model(12), config()) == 0  # a whole (duplicated) projection sums already
    hooked = model(6)  # the column shard: (8 + 4) / 2 rows
    assert mla_sequence_sharded_kv(hooked, config()) == 1
    with pytest.raises(RuntimeError, match="output width 12, expected the column shard's 6"):
        hooked["layer"].self_attention.linear_kv_down_proj._forward_hooks.popitem()[1](
            hooked["layer"].self_attention.linear_kv_down_proj, (None,), (torch.zeros(3, 1, 12), None))
