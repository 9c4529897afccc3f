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
