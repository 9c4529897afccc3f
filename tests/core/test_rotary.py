"""RotaryEmbedding / apply_rotary against the explicit per-pair rotation of tests/reference.py (float64)."""

from __future__ import annotations

import pytest
import torch

from headwise import RotaryEmbedding
from headwise.rotary import apply_rotary, rotate_half
from tests.reference import rope64


@pytest.mark.parametrize("rotary_dim", [None, 4, 2])
@pytest.mark.parametrize("batched_positions", [False, True])
def test_rotation_matches_the_pairwise_formula(rotary_dim, batched_positions):
    d_h, b, h, s = 8, 2, 3, 5
    rope = RotaryEmbedding(d_h, rotary_dim=rotary_dim)
    x = torch.randn(b, h, s, d_h, dtype=torch.float64)
    positions = torch.randint(0, 100, (b, s)) if batched_positions else torch.arange(3, 3 + s)
    cos, sin = rope(positions, torch.float64)
    got = apply_rotary(x, cos, sin)
    for head in range(h):
        torch.testing.assert_close(got[:, head], rope64(x[:, head], positions, rope.inv_freq))


def test_matches_the_textbook_form_and_leaves_its_input_alone():
    rope = RotaryEmbedding(8, rotary_dim=6)
    x = torch.randn(2, 3, 5, 8)
    before = x.clone()
    cos, sin = rope(torch.arange(5))
    got = apply_rotary(x, cos, sin)
    textbook = torch.cat((x[..., :6] * cos + rotate_half(x[..., :6]) * sin, x[..., 6:]), dim=-1)
    torch.testing.assert_close(got, textbook)
    assert torch.equal(x, before)


def test_gradients_through_the_in_place_accumulation():
    rope = RotaryEmbedding(6, rotary_dim=4)
    cos, sin = rope(torch.arange(4), torch.float64)
    x = torch.randn(1, 2, 4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos, sin), (x,))


def test_inv_freq_and_attention_scaling_are_checked():
    import numpy as np

    with pytest.raises(TypeError, match=r"inv_freq must be a floating torch.Tensor of shape \(4,\), got ndarray; "
                                        r"convert it with torch.from_numpy"):
        RotaryEmbedding(8, inv_freq=np.ones(4, dtype=np.float32))
    with pytest.raises(ValueError, match="attention_scaling must be a positive finite float, got nan"):
        RotaryEmbedding(8, attention_scaling=float("nan"))


@pytest.mark.parametrize("cast", ["to", "half"])
def test_a_dtype_cast_keeps_float32_frequencies_and_rotates_like_float64_at_large_positions(cast):
    from headwise import MultiHeadAttention

    d_h, b, h, s = 8, 1, 2, 6
    layer = MultiHeadAttention(16, 2, rotary=RotaryEmbedding(d_h))
    layer = layer.to(torch.bfloat16) if cast == "to" else layer.half()
    dtype = layer.q_proj.weight.dtype
    rope = layer.rotary
    inv_freq64 = 1.0 / 10000.0 ** (torch.arange(0, d_h, 2, dtype=torch.float64) / d_h)  # the formula, float64
    assert rope.inv_freq.dtype == torch.float32
    torch.testing.assert_close(rope.inv_freq.double(), inv_freq64)
    positions = torch.arange(4000, 4000 + s)
    torch.manual_seed(0)
    q, k = torch.randn(b, h, s, d_h).to(dtype), torch.randn(b, 1, s, d_h).to(dtype)
    q_rot, k_rot = rope.rotate(q, k, positions)
    assert q_rot.dtype == k_rot.dtype == dtype
    for got, x in ((q_rot, q), (k_rot, k)):
        # cos, sin and the products rounded to the output dtype: a few eps of |x1| + |x2|; frequencies rounded to
        # it put whole radians into the angles at these positions
        tol = dict(rtol=0, atol=4 * torch.finfo(dtype).eps * float(x.abs().max()))
        for head in range(x.shape[1]):
            torch.testing.assert_close(got[:, head].double(), rope64(x[:, head].double(), positions, inv_freq64),
                                       **tol)


def test_max_positions_refuses_positions_from_it_and_is_checked():
    rope = RotaryEmbedding(8, max_positions=5, rope_type="dynamic")
    q = k = torch.randn(2, 1, 5, 8)
    ok = rope.rotate(q, k, torch.arange(5))
    torch.testing.assert_close(ok, RotaryEmbedding(8).rotate(q, k, torch.arange(5)))
    for positions in (torch.arange(1, 6), torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 0, 7]])):
        with pytest.raises(ValueError, match=rf"positions reach {int(positions.max())}, but this dynamic rotary's "
                                             r"frequencies hold only for positions < 5"):
            rope.rotate(q, k, positions)
    assert "max_positions=5" in repr(rope)
    with pytest.raises(TypeError, match="max_positions must be an int or None, got float"):
        RotaryEmbedding(8, max_positions=5.0)
    with pytest.raises(ValueError, match="max_positions must be positive, got 0"):
        RotaryEmbedding(8, max_positions=0)


def test_a_rotary_built_on_meta_keeps_float32_frequencies_through_a_cast_and_to_empty():
    with torch.device("meta"):
        rotary = RotaryEmbedding(8)
    rotary.to(torch.bfloat16)
    assert rotary.inv_freq.dtype == torch.float32 and rotary.inv_freq.is_meta
    rotary.to_empty(device="cpu")
    assert rotary.inv_freq.dtype == torch.float32 and rotary.inv_freq.device.type == "cpu"
