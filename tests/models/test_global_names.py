"""Local parameter names (per pipeline stage, per expert-parallel rank, local or Transformer-Engine
layer specs) map to one global canonical name."""
from __future__ import annotations

import pytest

from megarl.models.weights import global_name


@pytest.mark.parametrize(
    "local,layer_offset,expert_offset,expected",
    [
        ("decoder.layers.0.self_attention.linear_qkv.weight", 4, 0, "decoder.layers.4.self_attention.linear_qkv.weight"),
        # Transformer-Engine fuses the norms into the next linear layer.
        ("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", 2, 0, "decoder.layers.3.input_layernorm.weight"),
        ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", 0, 0, "decoder.layers.0.pre_mlp_layernorm.weight"),
        ("decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight", 6, 4,
         "decoder.layers.8.mlp.experts.local_experts.5.linear_fc2.weight"),
        ("embedding.word_embeddings.weight", 3, 2, "embedding.word_embeddings.weight"),
        ("decoder.final_layernorm.weight", 3, 0, "decoder.final_layernorm.weight"),
    ],
)
def test_global_name(local, layer_offset, expert_offset, expected):
    assert global_name(local, layer_offset, expert_offset) == expected
