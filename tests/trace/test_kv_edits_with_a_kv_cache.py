"""Edits of k and v on a bare layer decoding with its own KVCache: each call sees only its new keys and values
(the cache holds the earlier ones), so an edit that averages over positions ("mean") is refused before the cache
write, leaving the cache as it was; edits of each position alone compose with the cache as with one causal call
(checked against a float64 plain-PyTorch attention)."""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import MultiHeadAttention

D, H, D_H = 24, 6, 4


def causal_attention64(attn, x, edit_k=None, edit_v=None):
    """The layer's causal self-attention in float64 from its projections, with k and v edited per head.

    Shapes: x (b, s, D); edit_k, edit_v: (b, H, s, D_H) -> (b, H, s, D_H) -> (b, s, D)"""
    w = {n: (getattr(attn, n).weight.double(), getattr(attn, n).bias.double())
         for n in ("q_proj", "k_proj", "v_proj", "out_proj")}
    b, s, _ = x.shape
    q, k, v = ((x.double() @ w[n][0].T + w[n][1]).view(b, s, H, D_H).transpose(1, 2)
               for n in ("q_proj", "k_proj", "v_proj"))
    k = k if edit_k is None else edit_k(k)
    v = v if edit_v is None else edit_v(v)
    scores = q @ k.transpose(-1, -2) / D_H ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    z = scores.softmax(-1) @ v  # (b, H, s, D_H)
    return z.transpose(1, 2).reshape(b, s, H * D_H) @ w["out_proj"][0].T + w["out_proj"][1]


def decode(attn, x, cache, prefill=4):
    return torch.cat([attn(x[:, :prefill], cache=cache)]
                     + [attn(x[:, s:s + 1], cache=cache) for s in range(prefill, x.shape[1])], 1)


@pytest.mark.parametrize("site", ["k", "v"])
def test_a_k_or_v_mean_with_a_kv_cache_is_refused_before_the_cache_write(site):
    torch.manual_seed(0)
    attn = MultiHeadAttention(d_model=D, n_heads=H).eval()
    x = torch.randn(2, 7, D)
    edit = {(0, 1, site): "mean"}
    with torch.no_grad():
        cache = attn.new_cache(batch_size=2, max_len=10)
        keys, values = cache.keys.clone(), cache.values.clone()
        with headwise.trace(attn, capture=("k",), edit=edit) as t:
            with pytest.raises(ValueError, match=rf"layer 0 head 1 {site}: 'mean' of k or v .* KVCache sees only"):
                attn(x[:, :4], cache=cache)  # a prefill too: its averaged keys would be written into the cache
        assert cache.length == 0 and len(t[0].calls) == 0
        torch.testing.assert_close(cache.keys, keys, rtol=0, atol=0)
        torch.testing.assert_close(cache.values, values, rtol=0, atol=0)
        attn(x[:, :4], cache=cache)
        keys, values = cache.keys.clone(), cache.values.clone()
        with headwise.trace(attn, edit=edit):
            with pytest.raises(ValueError, match="KVCache sees only"):
                attn(x[:, 4:5], cache=cache)  # a decoding step
        assert cache.length == 4
        torch.testing.assert_close(cache.keys, keys, rtol=0, atol=0)
        torch.testing.assert_close(cache.values, values, rtol=0, atol=0)
        with headwise.trace(attn, edit=edit):  # without a cache the mean is over the call's keys
            got = attn(x, causal=True)
    mean_of_head = lambda t: torch.cat([t[:, :1], t[:, 1:2].mean(2, keepdim=True).expand_as(t[:, 1:2]),  # noqa: E731
                                        t[:, 2:]], 1)
    want = causal_attention64(attn, x, **{f"edit_{site}": mean_of_head})
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_per_position_edits_of_k_and_v_compose_with_a_kv_cache():
    torch.manual_seed(1)
    attn = MultiHeadAttention(d_model=D, n_heads=H).eval()
    x = torch.randn(2, 7, D)
    with torch.no_grad(), headwise.trace(attn, capture=("k", "v")) as reference:
        attn(x, causal=True)
    means = reference[0].mean("k")  # (H, D_H): each head's key mean over the reference's rows and tokens
    row = torch.randn(D_H)
    edit = {(0, 0, "k"): ("mean", reference), (0, 1, "v"): 0.5, (0, 2, "k"): row,
            (0, 3, "v"): lambda v_h, layer, head: v_h.flip(-1), (0, 4, "k"): "zero"}
    with torch.no_grad():
        cache = attn.new_cache(batch_size=2, max_len=10)
        with headwise.trace(attn, edit=edit):
            got = decode(attn, x, cache)

    def edit_k(k):
        k = k.clone()
        k[:, 0], k[:, 2], k[:, 4] = means[0].double(), row.double(), 0.0
        return k

    def edit_v(v):
        v = v.clone()
        v[:, 1], v[:, 3] = 0.5 * v[:, 1], v[:, 3].flip(-1)
        return v

    torch.testing.assert_close(got.double(), causal_attention64(attn, x, edit_k, edit_v), rtol=1e-5, atol=1e-6)
