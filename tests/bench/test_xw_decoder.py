"""The x @ W preallocated decode loop (benchmarks.peers.XWDecoder): it must decode exactly what headwise's
layer decodes with its own KVCache, from the same cache content and the same weights (no timing here)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.peers import XWDecoder
from headwise import MultiHeadAttention, RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("h_kv", "bias"), [(4, True), (2, True), (4, False)])
def test_decodes_what_headwise_decodes(dtype, h_kv, bias):
    torch.manual_seed(0)
    d, h, ctx, steps = 32, 4, 5, 3
    attn = MultiHeadAttention(d, h, h_kv, bias=bias, dtype=dtype).eval()
    cache = attn.new_cache(2, ctx + steps)
    xw = XWDecoder(attn, 2, ctx + steps)
    k0, v0 = (torch.randn(2, h_kv, ctx, d // h, dtype=dtype) for _ in range(2))
    cache.update(k0, v0)
    xw.fill(k0, v0)
    with torch.no_grad():
        for _ in range(steps):
            x = torch.randn(2, 1, d, dtype=dtype)
            torch.testing.assert_close(xw(x), attn(x, cache=cache))
    assert xw.length == cache.length == ctx + steps
    torch.testing.assert_close(xw.keys, cache.keys)
    torch.testing.assert_close(xw.values, cache.values)


def test_weights_are_stored_d_in_by_d_out_contiguous_copies():
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4, 2).eval()
    xw = XWDecoder(attn, 1, 4)
    for w, lin in ((xw.w_q, attn.q_proj), (xw.w_k, attn.k_proj), (xw.w_v, attn.v_proj), (xw.w_o, attn.out_proj)):
        assert w.shape == (lin.in_features, lin.out_features) and w.is_contiguous()
        torch.testing.assert_close(w, lin.weight.detach().t(), rtol=0, atol=0)
    with torch.no_grad():
        attn.q_proj.weight.add_(1.0)  # a copy, not a view: the peer keeps the weights it was built with
    assert not torch.equal(xw.w_q, attn.q_proj.weight.detach().t())


def test_refuses_a_rotary_layer():
    attn = MultiHeadAttention(32, 4, bias=False, rotary=RotaryEmbedding(8))
    with pytest.raises(ValueError, match="rotary=None"):
        XWDecoder(attn, 1, 4)
