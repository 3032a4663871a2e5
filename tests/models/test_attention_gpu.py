"""The SDPA core attention on a CUDA GPU (the path of stock PyTorch images without
Transformer-Engine): flash / memory-efficient kernels in bfloat16 agree with the float64 formula,
for GQA and for multi-latent attention's unequal head sizes, padded and packed. Skipped, visibly,
where there is no GPU (tests/models/test_attention.py covers the same code in float32 on CPU)."""
from __future__ import annotations

import pytest
import torch

from test_attention import core, packed_params, qkv, reference

pytestmark = pytest.mark.gpu

# bfloat16 has an 8-bit mantissa: softmax-weighted sums of unit-variance values are good to about 2e-2.
BF16_ATOL = 3e-2


def padded_error(device: str, heads: int, groups: int, dk: int, dv: int) -> None:
    attention = core(heads=heads, groups=groups, head_dim=dk, k_channels=dk, v_channels=dv).to(device)
    q, k, v = qkv(256, 2, heads, groups, dk, dv)
    got = attention(*(t.to(device, torch.bfloat16) for t in (q, k, v)), None)
    torch.testing.assert_close(got.float().cpu(), reference(q, k, v, dk ** -0.5), rtol=0, atol=BF16_ATOL)


def packed_error(device: str) -> None:
    lens = [100, 37, 250, 7]
    attention = core(heads=8, groups=2, head_dim=64).to(device)
    q, k, v = (t[:, 0] for t in qkv(sum(lens), 1, 8, 2, 64, 64))  # thd: [tokens, heads, d]
    params = packed_params(lens)
    params.cu_seqlens_q, params.cu_seqlens_kv = params.cu_seqlens_q.to(device), params.cu_seqlens_kv.to(device)
    got = attention(*(t.to(device, torch.bfloat16) for t in (q, k, v)), None, packed_seq_params=params).float().cpu()
    start = 0
    for n in lens:
        one = slice(start, start + n)
        expected = reference(q[one, None], k[one, None], v[one, None], 64 ** -0.5)[:, 0]
        torch.testing.assert_close(got[one], expected, rtol=0, atol=BF16_ATOL)
        start += n


@pytest.mark.parametrize("heads,groups,dk,dv", [(8, 2, 64, 64), (8, 8, 192, 128)])  # GQA; MLA's 128+64 / 128
def test_bf16_sdpa_on_gpu_matches_the_formula(heads, groups, dk, dv):
    padded_error("cuda", heads, groups, dk, dv)


def test_bf16_packed_on_gpu_equals_each_sequence_alone():
    packed_error("cuda")
