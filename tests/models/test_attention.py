"""megarl's SDPA core attention computes causal softmax attention exactly as the textbook formula
and as Megatron's local attention: padded and packed (thd), GQA, and multi-latent attention's
unequal query/key and value head sizes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megarl.models.attention import SDPACoreAttention

ONE_TP = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))


def config(heads: int, groups: int, head_dim: int):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=head_dim, use_cpu_initialization=True,
                             attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False,
                             attention_softmax_in_fp32=True)


def core(heads: int, groups: int, head_dim: int, **channels) -> SDPACoreAttention:
    from megatron.core.transformer.enums import AttnMaskType

    return SDPACoreAttention(config(heads, groups, head_dim), 1, AttnMaskType.causal, pg_collection=ONE_TP, **channels)


def reference(q, k, v, scale: float, mask=None) -> torch.Tensor:
    """softmax(q k^T * scale, causal or masked) v in float64, [s, b, heads, d] in, [s, b, heads * dv] out."""
    q, k, v = (t.double() for t in (q, k, v))
    repeat = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(repeat, 2), v.repeat_interleave(repeat, 2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    if mask is None:
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    out = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v)
    return out.reshape(q.shape[0], q.shape[1], -1).float()


def qkv(s: int, b: int, heads: int, groups: int, dk: int, dv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(s, b, heads, dk, generator=g), torch.randn(s, b, groups, dk, generator=g),
            torch.randn(s, b, groups, dv, generator=g))


def test_padded_gqa_matches_the_formula():
    attention = core(heads=4, groups=2, head_dim=8)
    q, k, v = qkv(7, 3, 4, 2, 8, 8)
    got = attention(q, k, v, None)
    assert got.shape == (7, 3, 32)
    torch.testing.assert_close(got, reference(q, k, v, 8 ** -0.5), rtol=0, atol=1e-5)


def test_padded_gqa_gradients_match_the_formula():
    # Grouped K/V go to SDPA unexpanded (enable_gqa): each K/V head's gradient is the sum over
    # the query heads that share it, as with the expanded copy.
    attention = core(heads=6, groups=2, head_dim=8)
    q, k, v = (t.requires_grad_(True) for t in qkv(9, 2, 6, 2, 8, 8, seed=3))
    weights = torch.randn(9, 2, 48, generator=torch.Generator().manual_seed(4))
    (attention(q, k, v, None) * weights).sum().backward()
    got = [t.grad for t in (q, k, v)]
    q2, k2, v2 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    (reference(q2, k2, v2, 8 ** -0.5).double() * weights).sum().backward()
    for g, want in zip(got, (q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(g, want.float(), rtol=0, atol=1e-5)


def test_multi_latent_head_sizes():
    # MLA: query/key heads of 24 (nope 16 + rope 8), value heads of 16, its own softmax scale.
    attention = core(heads=4, groups=4, head_dim=32, k_channels=24, v_channels=16, softmax_scale=0.3)
    q, k, v = qkv(6, 2, 4, 4, 24, 16)
    got = attention(q, k, v, None)
    assert got.shape == (6, 2, 4 * 16)
    torch.testing.assert_close(got, reference(q, k, v, 0.3), rtol=0, atol=1e-5)


def test_boolean_mask_follows_megatron_convention():
    attention = core(heads=2, groups=1, head_dim=4)
    q, k, v = qkv(5, 1, 2, 1, 4, 4)
    mask = torch.zeros(5, 5, dtype=torch.bool)
    mask[:, 3:] = True  # True = masked out: nobody attends to the last two keys
    got = attention(q, k, v, mask[None, None])
    torch.testing.assert_close(got, reference(q, k, v, 0.5, mask), rtol=0, atol=1e-5)


def packed_params(lens: list[int]):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0] + lens).cumsum(0).int()
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens))


@pytest.mark.parametrize("lens", [[5, 1, 9, 3, 2, 9], [4, 4, 4]])  # several length groups; equal lengths
def test_packed_equals_each_sequence_alone_with_gradients(lens):
    attention = core(heads=4, groups=2, head_dim=8, k_channels=8, v_channels=6)
    q, k, v = (t[:, 0].requires_grad_() for t in qkv(sum(lens), 1, 4, 2, 8, 6, seed=3))
    got = attention(q, k, v, None, packed_seq_params=packed_params(lens))
    assert got.shape == (sum(lens), 24)
    pieces, start = [], 0
    for n in lens:
        piece = slice(start, start + n)
        pieces.append(reference(q[piece, None], k[piece, None], v[piece, None], 8 ** -0.5)[:, 0])
        start += n
    expected = torch.cat(pieces)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    weights = torch.randn_like(got)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_matches_megatron_local_attention(world_of_one):
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.models.packed_attention import PackedDotProductAttention

    cfg = config(heads=4, groups=2, head_dim=8)
    megatron = PackedDotProductAttention(cfg, 1, AttnMaskType.causal, "self")
    ours = SDPACoreAttention(cfg, 1, AttnMaskType.causal)
    q, k, v = qkv(9, 2, 4, 2, 8, 8, seed=5)
    torch.testing.assert_close(ours(q, k, v, None), megatron(q, k, v, None), rtol=0, atol=1e-5)
    lens, flat = [2, 7, 4, 5], (t[:, 0] for t in qkv(18, 1, 4, 2, 8, 8, seed=6))
    q, k, v = flat
    params = packed_params(lens)
    torch.testing.assert_close(ours(q, k, v, None, packed_seq_params=params),
                               megatron(q, k, v, None, packed_seq_params=params), rtol=0, atol=1e-5)
