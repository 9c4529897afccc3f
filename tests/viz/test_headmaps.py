"""HeadMaps checks its arrays against its tokens when it is built: every picture, page and table indexes them by
the tokens, so a mismatch is refused naming the shape expected and the one received."""

from __future__ import annotations

import pytest
import torch

from headwise import MultiHeadAttention
from headwise.viz.maps import HeadMaps, head_maps

W = torch.full((2, 3, 3), 1 / 3)
N = torch.ones(2, 3)
TOKENS = ["a", "b", "c"]


@pytest.mark.parametrize("kw, error, match", [
    (dict(weights=torch.full((2, 4, 4), 0.25), writes=None, value_norms=None), ValueError,
     r"weights must be \(h, s, s\) = \(h, 3, 3\) for 3 tokens, got \(2, 4, 4\)"),
    (dict(weights=torch.full((2, 3, 5), 0.2), writes=None, value_norms=None), ValueError,
     r"weights must be \(h, s, s\) = \(h, 3, 3\) for 3 tokens, got \(2, 3, 5\)"),
    (dict(weights=torch.full((3, 3), 1 / 3), writes=None, value_norms=None), ValueError,
     r"weights must be \(h, s, s\) = \(h, 3, 3\) for 3 tokens, got \(3, 3\)"),
    (dict(value_norms=torch.ones(2, 5)), ValueError,
     r"value_norms must be \(h, s\) = \(2, 3\) for 3 tokens and the weights' 2 heads, got \(2, 5\)"),
    (dict(writes=torch.zeros(1, 3, 3)), ValueError,
     r"writes must be \(h, s, s\) = \(2, 3, 3\) for 3 tokens and the weights' 2 heads, got \(1, 3, 3\)"),
    (dict(real=torch.ones(4, dtype=torch.bool)), ValueError, r"real must be \(s,\) = \(3,\) .* got \(4,\)"),
    (dict(heads=(0, 1, 2)), ValueError, r"heads must give one number per head \(the weights' 2\), got 3"),
    (dict(weights=[[[1.0]]]), TypeError, "weights must be a tensor, got list"),
    (dict(value_norms=[1.0, 1.0]), TypeError, "value_norms must be a tensor or None, got list"),
    (dict(layer="x"), TypeError, "layer must be an int, got str 'x'"),
    (dict(layer=True), TypeError, "layer must be an int, got bool True"),
    (dict(tokens=["a", 2, "c"]), TypeError, "tokens must be a list of str"),
])
def test_headmaps_refuses_arrays_that_do_not_fit_its_tokens(kw, error, match) -> None:
    args = dict(tokens=TOKENS, layer=0, weights=W, writes=W * N[:, None, :], value_norms=N) | kw
    with pytest.raises(error, match=match):
        HeadMaps(**args)


def test_pictures_of_two_layers_with_the_same_tokens_but_other_lengths_cannot_be_built() -> None:
    # the length is the tokens': a second layer's (2, 4, 4) weights over the same three tokens are refused
    good = head_maps(MultiHeadAttention(8, 2), torch.randn(3, 8), tokens=TOKENS)
    assert good.weights.shape == (2, 3, 3)
    with pytest.raises(ValueError, match=r"got \(2, 4, 4\)"):
        HeadMaps(tokens=good.tokens, layer=1, weights=torch.full((2, 4, 4), 0.25), writes=None, value_norms=None)


def test_head_maps_refuses_a_layer_that_is_not_an_int() -> None:
    with pytest.raises(TypeError, match="layer must be an int, got str 'x'"):
        head_maps(MultiHeadAttention(8, 2), torch.randn(3, 8), layer="x")


def test_a_valid_headmaps_and_its_subset_are_built() -> None:
    m = HeadMaps(TOKENS, 0, W, W * N[:, None, :], N, real=torch.tensor([True, True, False]))
    sub = m.subset([1])
    torch.testing.assert_close(sub.weights, W[[1]])
    torch.testing.assert_close(sub.value_norms, N[[1]])
    assert sub.head_ids == [1]
