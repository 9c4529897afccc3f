"""Masks in one place (headwise.masks): each constructor against an explicit formula, composition, polarity,
and the acceptance rules of validate_mask. (Every error branch is a row of test_bad_input.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from headwise import MultiHeadAttention
from headwise import masks as hwm
from tests.reference import reference_mha as reference

SIZES = [(0, 0), (1, 1), (1, 4), (3, 3), (2, 5), (5, 2), (4, 0), (0, 3)]


def formula(s_q, s_kv, align, window=None):
    """allowed[i][j] from the definition: query i sits at p = i + offset, reads keys j <= p (and j > p - window)."""
    offset = s_kv - s_q if align == "bottom_right" else 0
    return torch.tensor([[j <= i + offset and (window is None or j > i + offset - window) for j in range(s_kv)]
                         for i in range(s_q)], dtype=torch.bool).reshape(s_q, s_kv)


@pytest.mark.parametrize("align", hwm.ALIGNMENTS)
@pytest.mark.parametrize("s_q, s_kv", SIZES)
def test_causal_mask_both_alignments(align, s_q, s_kv):
    m = hwm.causal_mask(s_q, s_kv, align=align)
    assert m.dtype == torch.bool and m.shape == (s_q, s_kv)
    assert torch.equal(m, formula(s_q, s_kv, align))


@pytest.mark.parametrize("s_q, s_kv", SIZES)
def test_alignments_agree_exactly_when_square(s_q, s_kv):
    same = torch.equal(hwm.causal_mask(s_q, s_kv), hwm.causal_mask(s_q, s_kv, align="top_left"))
    assert same == (s_q == s_kv or s_q == 0 or s_kv == 0)
    assert torch.equal(hwm.causal_mask(s_q, s_kv, align="bottom_right"), hwm.causal_mask(s_q, s_kv))  # the default


@pytest.mark.parametrize("align", hwm.ALIGNMENTS)
@pytest.mark.parametrize("window", [1, 2, 3, 10])
@pytest.mark.parametrize("s_q, s_kv", SIZES)
def test_sliding_window_mask(align, window, s_q, s_kv):
    assert torch.equal(hwm.sliding_window_mask(s_q, s_kv, window=window, align=align),
                       formula(s_q, s_kv, align, window))


def test_padding_mask_from_lengths_and_keep():
    right = hwm.padding_mask(lengths=[3, 1, 0], s_kv=3)
    left = hwm.padding_mask(lengths=torch.tensor([3, 1, 0]), s_kv=3, left=True)
    assert right.shape == left.shape == (3, 1, 1, 3)
    assert right[:, 0, 0].tolist() == [[True, True, True], [True, False, False], [False, False, False]]
    assert left[:, 0, 0].tolist() == [[True, True, True], [False, False, True], [False, False, False]]
    keep = torch.tensor([[True, False, True]])
    assert torch.equal(hwm.padding_mask(keep), keep[:, None, None, :])
    assert hwm.padding_mask(lengths=[2, 4]).shape == (2, 1, 1, 4)  # s_kv defaults to the longest
    assert hwm.padding_mask(lengths=[], s_kv=3).shape == (0, 1, 1, 3)  # an empty batch


def test_torch_key_padding_mask_polarity_is_inverted_by_keep():
    """nn.MultiheadAttention's key_padding_mask is True = ignore; headwise's keep is True = attend."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    attn = MultiHeadAttention(16, 4).eval()
    with torch.no_grad():
        w = m.in_proj_weight
        attn.q_proj.weight.copy_(w[:16]), attn.k_proj.weight.copy_(w[16:32]), attn.v_proj.weight.copy_(w[32:])
        b = m.in_proj_bias
        attn.q_proj.bias.copy_(b[:16]), attn.k_proj.bias.copy_(b[16:32]), attn.v_proj.bias.copy_(b[32:])
        attn.out_proj.load_state_dict(m.out_proj.state_dict())
    x = torch.randn(2, 5, 16)
    kpm = torch.tensor([[False] * 5, [False, False, True, True, True]])
    ref = m(x, x, x, key_padding_mask=kpm, need_weights=False)[0]
    torch.testing.assert_close(attn(x, mask=hwm.padding_mask(~kpm)), ref)
    assert not torch.allclose(attn(x, mask=hwm.padding_mask(kpm)), ref)


def test_combine_bool_masks_is_logical_and():
    a, b = hwm.causal_mask(4), hwm.padding_mask(lengths=[4, 2], s_kv=4)
    out = hwm.combine_masks(a, None, b)
    assert out.dtype == torch.bool and out.shape == (2, 1, 4, 4)
    assert torch.equal(out, a & b)
    assert hwm.combine_masks() is None and hwm.combine_masks(None, None) is None
    assert hwm.combine_masks(a) is a


def test_combine_with_a_float_mask_is_additive():
    bias = torch.randn(1, 1, 3, 3, dtype=torch.float64)
    out = hwm.combine_masks(hwm.causal_mask(3), bias)
    assert out.dtype == torch.float64
    expected = bias.masked_fill(~hwm.causal_mask(3), -math.inf)
    assert torch.equal(out, expected)
    assert hwm.combine_masks(hwm.causal_mask(3), bias, dtype=torch.float16).dtype == torch.float16


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_bool_and_additive_float_masks_mean_the_same(backend):
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, 2, backend=backend).eval()
    x = torch.randn(2, 5, 16)
    allowed = torch.rand(2, 4, 5, 5) < 0.6
    additive = torch.zeros(2, 4, 5, 5).masked_fill(~allowed, -math.inf)
    y_bool, y_float = attn(x, mask=allowed), attn(x, mask=additive)
    torch.testing.assert_close(y_bool, y_float)
    torch.testing.assert_close(y_bool.double(), reference(attn, x, mask=allowed)[0], rtol=1e-4, atol=1e-5)
    for i in range(4):  # per-head masks reach each head alone too
        torch.testing.assert_close(attn.head(i)(x, mask=allowed), attn.head(i)(x, mask=additive))


@pytest.mark.parametrize("shape", [(), (5,), (5, 5), (1, 5), (2, 1, 1, 5), (2, 4, 5, 5), (1, 1, 5, 5), (4, 5, 5)])
def test_validate_mask_accepts_every_broadcastable_shape(shape):
    m = torch.rand(shape) > 0.5
    out = hwm.validate_mask(m, (2, 4, 5, 5), torch.float32, torch.device("cpu"))
    # bool masks come back as a 4-D view of the same memory (no copy); 4-D ones unchanged
    assert out.shape == (1,) * (4 - len(shape)) + shape and out.dtype == torch.bool
    assert out.data_ptr() == m.data_ptr() and torch.equal(out.reshape(shape), m)
    assert (out is m) == (len(shape) == 4)


def test_validate_mask_casts_float_masks_to_the_compute_dtype():
    m = torch.zeros(5, 5, dtype=torch.float64)
    out = hwm.validate_mask(m, (2, 4, 5, 5), torch.bfloat16, torch.device("cpu"))
    assert out.dtype == torch.bfloat16
    same = torch.zeros(1, 1, 5, 5)
    assert hwm.validate_mask(same, (2, 4, 5, 5), torch.float32, torch.device("cpu")) is same
    low = torch.zeros(5, 5)
    assert hwm.validate_mask(low, (2, 4, 5, 5), torch.float32, torch.device("cpu"))._base is low  # a view


def test_sliding_window_through_the_layer_matches_the_reference():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 6, 16)
    mask = hwm.combine_masks(hwm.sliding_window_mask(6, window=2), hwm.padding_mask(lengths=[6, 4], s_kv=6))
    for backend in ("sdpa", "eager"):
        attn.backend = backend
        torch.testing.assert_close(attn(x, mask=mask).double(), reference(attn, x, mask=mask)[0], rtol=1e-4, atol=1e-5)
