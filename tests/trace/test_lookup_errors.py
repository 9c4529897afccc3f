"""A trace asked for a layer or a capture it does not have refuses with a ValueError naming what there is
(it is also a KeyError, the lookup convention of ``t[name]``)."""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import MultiHeadAttention


def _traced(capture=("z",)):
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, 2)
    with headwise.trace(attn, capture=capture) as t:
        attn(torch.randn(2, 3, 16))
    return attn, t


@pytest.mark.parametrize("lookup, message", [
    (lambda t: t["nope"], r"no traced layer is named 'nope'; the layers are \[''\]"),
    (lambda t: t[MultiHeadAttention(16, 4)], "that MultiHeadAttention is not one of the traced layers"),
    (lambda t: t[0].pattern, r"layer 0 \(''\) did not capture 'pattern': it captured \['z'\]"),
    (lambda t: t[0].get("zz"), "'zz' is not capturable; choose from"),
])
def test_unknown_layers_and_captures_are_value_errors(lookup, message):
    attn, t = _traced()
    before = t[0].z.clone()
    with pytest.raises(ValueError, match=message) as info:
        lookup(t)
    assert isinstance(info.value, KeyError)
    assert str(info.value) == info.value.args[0]  # the message itself, not KeyError's quoted repr
    torch.testing.assert_close(t[0].z, before, rtol=0, atol=0)
    assert attn.tracer is None


def test_an_edit_naming_an_unknown_layer_is_refused_before_the_trace_starts():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, 2)
    with pytest.raises(ValueError, match="no traced layer is named 'nope'"):
        headwise.trace(attn, edit={("nope", 0): "zero"})
    assert attn.tracer is None


def test_captures_of_calls_with_different_batch_sizes_are_refused_naming_both_shapes():
    torch.manual_seed(0)
    attn = MultiHeadAttention(8, 2).eval()
    x1, x2 = torch.randn(1, 3, 8), torch.randn(2, 3, 8)
    with torch.no_grad(), headwise.trace(attn, capture=("z", "q", "result")) as t:
        attn(x1)
        attn(x2)
    for name, shapes in (("z", r"\(1, 3, 2, 4\).*\(2, 3, 2, 4\)"), ("q", r"\(1, 2, 3, 4\).*\(2, 2, 3, 4\)"),
                         ("result", r"\(1, 3, 2, 8\).*\(2, 3, 2, 8\)")):
        with pytest.raises(ValueError, match=rf"'{name}' of its calls.*call 0 is {shapes}"):
            t[0].get(name)
    with torch.no_grad(), headwise.trace(attn, capture=("z",)) as alone:
        attn(x2)
    torch.testing.assert_close(t[0].calls[1]["z"], alone[0].z)  # each call's own stays readable


def test_keys_values_and_patterns_of_several_calls_are_not_joined_even_of_one_length():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4).eval()
    x1, x2 = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    with torch.no_grad(), headwise.trace(attn, capture=("k", "v", "pattern")) as t:
        attn(x1)
        attn(x2)
    for name in ("k", "v", "pattern"):
        with pytest.raises(ValueError, match=rf"'{name}' of several calls is not joined, since their key lengths "
                                             rf"may differ: use \.calls\[i\]"):
            t[0].get(name)
    k2 = attn.k_proj(x2).view(2, 3, 4, 4).transpose(1, 2)
    torch.testing.assert_close(t[0].calls[1]["k"], k2)  # each call's own stays readable
