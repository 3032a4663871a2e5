"""Hand-worked values for the masked reductions."""
import math

import pytest
import torch

from megarl.algorithms import masked_mean, masked_sum, masked_var, masked_whiten

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [0, 1, 1]])  # selects 1, 2, 5, 6


def test_masked_sum_and_mean():
    # 1 + 2 + 5 + 6 = 14 over 4 tokens; per row: 1 + 2 = 3 and 5 + 6 = 11.
    assert masked_sum(X, MASK).item() == 14.0
    assert masked_mean(X, MASK).item() == 3.5
    torch.testing.assert_close(masked_sum(X, MASK, dim=-1), torch.tensor([3.0, 11.0], dtype=torch.float64))
    torch.testing.assert_close(masked_mean(X, MASK, dim=-1), torch.tensor([1.5, 5.5], dtype=torch.float64))


def test_masked_values_are_ignored_even_when_nan_and_all_masked_row_gives_zero():
    x = torch.tensor([[1.0, float("nan")], [float("inf"), 7.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 0], [0, 0]])  # row 1 is all masked
    row_means = masked_mean(x, mask, dim=-1)
    torch.testing.assert_close(row_means, torch.tensor([1.0, 0.0], dtype=torch.float64))
    row_means.sum().backward()
    # d/dx of the row-0 mean is 1 for the one selected entry; nothing else gets gradient, nothing is NaN.
    torch.testing.assert_close(x.grad, torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64))


def test_masked_var_unbiased_and_biased():
    # selected [1, 2, 5, 6], mean 3.5, squared deviations 6.25 + 2.25 + 2.25 + 6.25 = 17
    assert masked_var(X, MASK, unbiased=False).item() == pytest.approx(17 / 4)
    assert masked_var(X, MASK).item() == pytest.approx(17 / 3)


def test_masked_whiten():
    # (x - 3.5) / sqrt(17/3 + 1e-8); masked entries are transformed too (verl's behaviour)
    expected = (X - 3.5) / math.sqrt(17 / 3 + 1e-8)
    torch.testing.assert_close(masked_whiten(X, MASK), expected)
    torch.testing.assert_close(masked_whiten(X, MASK, shift_mean=False), expected + 3.5)


def test_masked_var_needs_two_entries():
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(X, torch.tensor([[1, 0, 0], [0, 0, 0]]))
