"""The float64 algebra of slim attention, against direct computation."""

from __future__ import annotations

import pytest
import torch

from kvconvert import linalg

F64 = torch.float64


def test_key_to_value_map_square():
    torch.manual_seed(0)
    wk, wv = torch.randn(32, 32, dtype=F64), torch.randn(32, 32, dtype=F64)
    x = torch.randn(100, 32, dtype=F64)
    m = linalg.key_to_value_map(wk, wv)
    torch.testing.assert_close((x @ wk.T) @ m.T, x @ wv.T, rtol=1e-9, atol=1e-9)


def test_key_to_value_map_right_inverse_for_wide_keys():
    """Paper §5 option 1: e > d uses W_K⁻¹ = W_Kᵀ(W_K W_Kᵀ)⁻¹; V is still exact."""
    torch.manual_seed(1)
    wk, wv = torch.randn(48, 32, dtype=F64), torch.randn(48, 32, dtype=F64)  # e = 48 > d = 32
    x = torch.randn(100, 32, dtype=F64)
    m = linalg.key_to_value_map(wk, wv)
    assert m.shape == (48, 48)
    torch.testing.assert_close((x @ wk.T) @ m.T, x @ wv.T, rtol=1e-9, atol=1e-9)


def test_narrow_keys_are_rejected():
    with pytest.raises(ValueError):
        linalg.key_to_value_map(torch.randn(16, 32), torch.randn(16, 32))


def test_bias_folding_reproduces_attention_output():
    """softmax-weighted V with biases, then W_O, equals slim's K·W_KV path with the folded bias."""
    torch.manual_seed(2)
    d, e, n = 16, 16, 9
    wk, wv, wo = (torch.randn(e, d, dtype=F64) for _ in range(3))
    bk, bv, bo = torch.randn(e, dtype=F64), torch.randn(e, dtype=F64), torch.randn(d, dtype=F64)
    x = torch.randn(n, d, dtype=F64)
    p = torch.softmax(torch.randn(n, dtype=F64), dim=0)  # any attention row sums to one
    reference = wo @ (p @ (x @ wv.T + bv)) + bo
    m = linalg.key_to_value_map(wk, wv)
    folded = linalg.fold_value_bias(bv, bk, m, wo, bo)
    k = x @ wk.T + bk  # the cache holds biased keys
    torch.testing.assert_close(wo @ ((p @ k) @ m.T) + folded, reference, rtol=1e-9, atol=1e-9)


def test_condition_number():
    assert linalg.condition_number(torch.diag(torch.tensor([4.0, 2.0, 0.5]))) == pytest.approx(8.0)
    assert linalg.condition_number(torch.zeros(2, 2)) == float("inf")
