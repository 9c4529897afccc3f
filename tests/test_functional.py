"""The functional core: split/merge are views/inverses, and the classic flatten bug is caught."""

from __future__ import annotations

import pytest
import torch

from headwise.functional import attention, eager_attention, merge_heads, sdpa_attention, split_heads
from headwise.masks import causal_mask


def test_split_is_a_view_and_merge_inverts_it():
    x = torch.randn(2, 5, 12)
    heads = split_heads(x, 3)
    assert heads.shape == (2, 3, 5, 4) and heads._base is x
    assert torch.equal(heads[1, 2, 3], x[1, 3, 8:12])
    assert torch.equal(merge_heads(heads), x)


def test_flatten_without_transpose_is_a_different_tensor_of_the_same_shape():
    ctx = torch.randn(2, 3, 5, 4)
    wrong = ctx.reshape(2, 5, 12)
    assert wrong.shape == merge_heads(ctx).shape
    assert not torch.equal(wrong, merge_heads(ctx))


def test_split_rejects_a_width_that_does_not_divide():
    with pytest.raises(ValueError, match="cannot split width 10 into n_heads=3"):
        split_heads(torch.randn(1, 2, 10), 3)


@pytest.mark.parametrize("s_q, s_kv", [(4, 4), (1, 6), (3, 6), (6, 3)])
def test_causal_is_bottom_right_on_both_backends(s_q, s_kv):
    q = torch.randn(2, 4, s_q, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, s_kv, 8, dtype=torch.float64), torch.randn(2, 2, s_kv, 8, dtype=torch.float64)
    explicit = causal_mask(s_q, s_kv, align="bottom_right")
    ref, w = eager_attention(q, k, v, mask=explicit)
    torch.testing.assert_close(eager_attention(q, k, v, causal=True)[0], ref)
    torch.testing.assert_close(sdpa_attention(q, k, v, causal=True)[0], ref)
    if s_q > s_kv:  # the first queries sit before every key: they read nothing and return zeros
        assert torch.equal(ref[:, :, : s_q - s_kv], torch.zeros_like(ref[:, :, : s_q - s_kv]))


def test_empty_inputs_give_empty_or_zero_outputs():
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 0, 8)
    for backend in ("sdpa", "eager"):
        out, _ = attention(q, k, k, backend=backend)
        assert torch.equal(out, torch.zeros(2, 4, 3, 8))
    with pytest.raises(ValueError, match=r"backend must be one of \['eager', 'sdpa'\], got 'flash'"):
        attention(q, q, q, backend="flash")


def test_eager_half_precision_does_not_overflow():
    q = torch.full((1, 1, 2, 64), 40.0, dtype=torch.float16)  # q.k = 102400 > float16 max 65504
    out, w = eager_attention(q, q, torch.randn(1, 1, 2, 64, dtype=torch.float16))
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
