"""Grouped-query attention: the folded form CUDA runs computes what SDPA's enable_gqa does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specd.workers.models.layers import attention, fold_gqa


def _inputs(b: int, heads: int, kv_heads: int, n: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, heads, 8, generator=g, dtype=torch.float64).transpose(1, 2)  # a strided view
    keys = torch.randn(b, kv_heads, length, 8, generator=g, dtype=torch.float64)
    values = torch.randn(b, kv_heads, length, 8, generator=g, dtype=torch.float64)
    return q, keys, values


def _tree_mask(b: int, n: int, length: int, starts: list[int]) -> torch.Tensor:  # [b, 1, n, length]
    """Committed keys before each row's start, then a small tree among the new tokens (node 2 is a
    sibling of node 1), padding past start + n unseen."""
    mask = torch.zeros(b, 1, n, length, dtype=torch.bool)
    for row, start in enumerate(starts):
        mask[row, 0, :, :start] = True
        for t in range(n):
            mask[row, 0, t, start + t] = True
            mask[row, 0, t, start] = True
            if t >= 3:
                mask[row, 0, t, start + 1] = True
    return mask


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("n", [1, 4])
def test_folded_heads_equal_enable_gqa(heads, kv_heads, n):
    q, keys, values = _inputs(2, heads, kv_heads, n, 12)
    for mask in (_tree_mask(2, n, 12, [3, 7]), None):
        want = F.scaled_dot_product_attention(q, keys, values, mask, enable_gqa=True, scale=0.3)
        got = fold_gqa(q, keys, values, mask, 0.3)
        assert got.shape == (2, heads, n, 8)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_each_query_head_reads_its_own_kv_head():
    """Heads 0-2 share KV head 0 and heads 3-5 KV head 1: values constant per KV head show which one
    each query head read, whatever the scores."""
    q, keys, _ = _inputs(1, 6, 2, 2, 5)
    values = torch.stack([torch.full((5, 8), 1.0), torch.full((5, 8), 2.0)])[None].double()
    out = fold_gqa(q, keys, values, None, None)  # [1, 6, 2, 8]
    assert out[0, :3].eq(1.0).all() and out[0, 3:].eq(2.0).all()


def test_cpu_attention_is_sdpa_with_enable_gqa():
    q, keys, values = _inputs(2, 9, 3, 4, 12, seed=1)
    mask = _tree_mask(2, 4, 12, [2, 5])
    want = F.scaled_dot_product_attention(q, keys, values, mask, enable_gqa=True)
    assert torch.equal(attention(q, keys, values, mask, None), want)
