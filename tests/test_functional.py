"""The functional core: split/merge are views/inverses, and the classic flatten bug is caught."""

from __future__ import annotations

import pytest
import torch

from headwise.functional import attention, merge_heads, split_heads, split_qkv


def eager_attention(q, k, v, **kw):
    return attention(q, k, v, backend="eager", **kw)


def sdpa_attention(q, k, v, **kw):
    return attention(q, k, v, backend="sdpa", **kw)
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


class _Copies(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shape and strides of every tensor a copying op materialises."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default, torch.ops.aten.contiguous.default):
            self.made.append((tuple(out.shape), out.stride()))
        return out


def _per_head_reference(q, k, v):
    g = q.shape[1] // k.shape[1]
    out = torch.empty_like(q, dtype=torch.float64)
    for i in range(q.shape[1]):
        qi, ki, vi = q[:, i].double(), k[:, i // g].double(), v[:, i // g].double()
        out[:, i] = torch.softmax(qi @ ki.transpose(-2, -1) / q.shape[-1] ** 0.5, -1) @ vi
    return out


@pytest.mark.parametrize("h_kv", [4, 2])
def test_eager_never_copies_k_transposed_and_never_copies_a_cache_slice(h_kv):
    # The head split leaves K strided (b and heads not mergeable): the batched matmul must read K^T through
    # BLAS's transpose flag after a row-wise copy, not materialise K^T. A KV-cache slice (mergeable) is not
    # copied at all: that copy would cost O(context) per decoded token.
    b, s, h, d_h = 3, 7, 4, 8
    x = torch.randn(b, s, h + 2 * h_kv, d_h)
    q = x[:, :, :h].transpose(1, 2)  # (b, h, s, d_h), strided as after split_heads
    k, v = x[:, :, h:h + h_kv].transpose(1, 2), x[:, :, h + h_kv:].transpose(1, 2)  # (b, h_kv, s, d_h)
    with torch.no_grad(), _Copies() as rec:
        out, _ = eager_attention(q, k, v)
    torch.testing.assert_close(out.double(), _per_head_reference(q, k, v), rtol=1e-5, atol=1e-6)
    assert rec.made, "the strided K/V must be laid out once"
    # row-wise copies of K and V only, (..., s, d_h) with unit inner stride: never K^T laid out (..., d_h, s)
    assert all(shape[-2:] == (s, d_h) and stride[-1] == 1 for shape, stride in rec.made), rec.made
    cache = torch.randn(b, h_kv, 16, d_h)
    k_slice = cache[:, :, :s]
    v_slice = torch.randn(b, h_kv, 16, d_h)[:, :, :s]
    q1 = torch.randn(b, h, 1, d_h)
    with torch.no_grad(), _Copies() as rec:
        out, _ = eager_attention(q1, k_slice, v_slice)
    torch.testing.assert_close(out.double(), _per_head_reference(q1, k_slice, v_slice), rtol=1e-5, atol=1e-6)
    assert rec.made == [], rec.made


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("h_kv", [4, 2, 1])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float", "blocked rows"])
def test_in_place_eager_variant_equals_the_reference(dtype, h_kv, mask_kind):
    """Without autograd the eager path runs its in-place speed variant; it must equal the reference formula
    (which runs whenever autograd records) bit for bit on the outputs' values."""
    g = torch.Generator().manual_seed(h_kv)
    b, h, s_q, s_kv, d_h = 3, 4, 5, 6, 8
    q = torch.randn(b, h, s_q, d_h, generator=g).to(dtype)
    k, v = (torch.randn(b, h_kv, s_kv, d_h, generator=g).to(dtype) for _ in range(2))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, 1, s_q, s_kv, generator=g) > 0.3
    elif mask_kind == "float":
        mask = torch.randn(b, h, s_q, s_kv, generator=g).to(dtype)
    elif mask_kind == "blocked rows":
        mask = torch.zeros(s_q, s_kv).to(dtype)
        mask[1] = float("-inf")
    with torch.no_grad():
        fast_out, fast_w = eager_attention(q, k, v, mask=mask, causal=True)
    ref_out, ref_w = eager_attention(q.requires_grad_(), k, v, mask=mask, causal=True)
    torch.testing.assert_close(fast_out, ref_out.detach())
    torch.testing.assert_close(fast_w, ref_w.detach())


@pytest.mark.parametrize("h, h_kv", [(4, 4), (8, 2), (6, 1)])
def test_split_qkv_gives_the_views_of_splitting_q_k_v_apart_first(h, h_kv):
    d_h = 5
    qkv = torch.randn(2, 7, (h + 2 * h_kv) * d_h)
    q, k, v = split_qkv(qkv, h, h_kv)
    parts = qkv.split([h * d_h, h_kv * d_h, h_kv * d_h], dim=-1)
    for got, part, n in zip((q, k, v), parts, (h, h_kv, h_kv)):
        want = split_heads(part, n)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got.stride() == want.stride() and got.data_ptr() == want.data_ptr()  # views, never copies


def test_split_qkv_refuses_widths_that_are_not_whole_heads():
    with pytest.raises(ValueError, match="cannot split width 30 into n_heads=4"):
        split_qkv(torch.randn(1, 2, 30), 2, 1)
    with pytest.raises(ValueError, match="n_kv_heads must be a positive int"):
        split_qkv(torch.randn(1, 2, 32), 4, 0)
    # a bad query-head count is named too (before, -1 + 2 * 2 = 3 heads split and torch raised later)
    for bad in (-1, 0, True, 2.0):
        with pytest.raises(ValueError, match="n_heads must be a positive int"):
            split_qkv(torch.randn(1, 2, 24), bad, 2)
