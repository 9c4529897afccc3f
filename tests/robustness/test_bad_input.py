"""One table: every public entry point, every bad input, the exception type and the message it must carry.

Each row is (id, call, expected exception type, regex the message must match). Messages name what was
expected and what was received, so the fragments below include both where the message has both.
Rows for optional subpackages (interop, analysis, CLI) are at the end.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from headwise import AttentionConfig, AttentionHead, KVCache, MultiHeadAttention, RotaryEmbedding
from headwise import functional as hwf
from headwise import masks
from headwise.walkthrough import walk

D, H, H_KV, D_H = 16, 4, 2, 4


def layer(**kw) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(D, H, H_KV, **kw)


def x(b: int = 2, s: int = 3, d: int = D, **kw) -> torch.Tensor:
    return torch.randn(b, s, d, **kw)


def qkv(q=(2, 4, 3, 4), k=(2, 2, 5, 4), v=None, dtype=torch.float32):
    return torch.randn(q, dtype=dtype), torch.randn(k), torch.randn(v or k)


def rotary_layer() -> MultiHeadAttention:
    return MultiHeadAttention(D, H, rotary=RotaryEmbedding(D_H))


def filled_cache(attn: MultiHeadAttention, b: int, max_len: int, n: int) -> KVCache:
    cache = attn.new_cache(b, max_len)
    attn(x(b, n), cache=cache)
    return cache


def head_pair_with_different_kv() -> list[AttentionHead]:
    torch.manual_seed(0)
    a = AttentionHead(torch.randn(D, D_H), torch.randn(D, D_H), torch.randn(D, D_H))
    b = AttentionHead(torch.randn(D, D_H), torch.randn(D, D_H), torch.randn(D, D_H))
    return [a, b]


def set_head_weight(shape):
    h = layer().head(0)
    h.w_q = torch.zeros(shape)


CORE = [
    # ---- MultiHeadAttention(...) / from_config ---------------------------------------------------------
    ("mha.init n_heads divides", lambda: MultiHeadAttention(16, 5), ValueError,
     r"n_heads=5 does not divide d_model=16; head counts that do near 5: \[2, 4, 8, 16\]"),
    ("mha.init n_kv_heads divides", lambda: MultiHeadAttention(16, 4, 3), ValueError,
     r"n_kv_heads=3 does not divide n_heads=4; valid n_kv_heads: \[1, 2, 4\]"),
    ("mha.init backend", lambda: MultiHeadAttention(16, 4, backend="flash"), ValueError,
     r"backend must be one of \['eager', 'sdpa'\], got 'flash'"),
    ("mha.init rotary type", lambda: MultiHeadAttention(16, 4, rotary="rope"), TypeError,
     "rotary must be a RotaryEmbedding, got str"),
    ("mha.init rotary width", lambda: MultiHeadAttention(16, 4, rotary=RotaryEmbedding(8)), ValueError,
     "rotary was built for d_head=8, the layer has d_head=4"),
    ("mha.from_config type", lambda: MultiHeadAttention.from_config({"d_model": 8}), TypeError,
     "config must be an AttentionConfig, got dict"),
    # ---- MultiHeadAttention.forward --------------------------------------------------------------------
    ("forward x type", lambda: layer()([[0.0] * D]), TypeError, "x must be a torch.Tensor, got list"),
    ("forward x width", lambda: layer()(x(d=12)), ValueError,
     r"x must have shape \(b, s, d_model=16\) or \(s, d_model=16\), got \(2, 3, 12\)"),
    ("forward x rank", lambda: layer()(torch.randn(1, 2, 3, D)), ValueError,
     r"x must have shape \(b, s, d_model=16\) or \(s, d_model=16\), got \(1, 2, 3, 16\)"),
    ("forward x dtype", lambda: layer()(x(dtype=torch.float64)), TypeError,
     "x has dtype torch.float64 but the weights are torch.float32"),
    ("forward x device", lambda: layer()(x(device="meta")), ValueError, "x is on meta but the weights are on cpu"),
    ("forward context width", lambda: layer()(x(), x(d=8)), ValueError,
     r"context must have shape \(b, s, kdim=16\) or \(s, kdim=16\), got \(2, 3, 8\)"),
    ("forward context batch", lambda: layer()(x(), x(b=3)), ValueError,
     "batch mismatch: x has b=2, key/context has b=3"),
    ("forward context rank", lambda: layer()(x(), torch.randn(4, D)), ValueError,
     r"context must be batched \(b, s, width\) like the query input, got \(4, 16\)"),
    ("forward context dtype", lambda: layer()(x(), x(dtype=torch.float64)), TypeError,
     "context has dtype torch.float64 but the weights are torch.float32"),
    ("forward key without value", lambda: layer()(x(), key=x()), ValueError, r"pass both key= and value= \(or neither\)"),
    ("forward key and context", lambda: layer()(x(), x(), key=x(), value=x()), ValueError,
     "pass either context= or key=/value=, not both"),
    ("forward key/value length", lambda: layer()(x(), key=x(s=4), value=x(s=5)), ValueError,
     "key has s_kv=4 but value has s_kv=5"),
    ("forward kdim != vdim context", lambda: MultiHeadAttention.from_config(
        AttentionConfig(d_model=16, n_heads=4, kdim=8, vdim=6))(x(), x(d=8)), ValueError,
     "kdim=8 != vdim=6: pass key= and value= separately"),
    ("forward mask type", lambda: layer()(x(), mask=[[True] * 3] * 3), TypeError,
     r"mask must be a torch.Tensor \(bool: True = may attend; or floating: added to scores\), got list"),
    ("forward mask dtype", lambda: layer()(x(), mask=torch.ones(3, 3, dtype=torch.int64)), TypeError,
     r"mask must be bool \(True = may attend\) or floating \(added to the scores\), got torch.int64"),
    ("forward mask shape", lambda: layer()(x(), mask=torch.ones(3, 4, dtype=torch.bool)), ValueError,
     r"mask of shape \(3, 4\) does not broadcast to \(b, h, s_q, s_kv\) = \(2, 4, 3, 3\)"),
    ("forward mask rank 5", lambda: layer()(x(), mask=torch.ones(1, 2, 4, 3, 3, dtype=torch.bool)), ValueError,
     r"mask of shape \(1, 2, 4, 3, 3\) does not broadcast to \(b, h, s_q, s_kv\) = \(2, 4, 3, 3\)"),
    ("forward mask device", lambda: layer()(x(), mask=torch.ones(3, 3, dtype=torch.bool, device="meta")),
     ValueError, "mask is on meta, but the inputs are on cpu"),
    ("forward causal string", lambda: layer()(x(), causal="top_left"), TypeError,
     r"causal must be a bool \(True = bottom-right aligned\), got 'top_left'; for top-left alignment pass "
     r"mask=headwise.masks.causal_mask\(s_q, s_kv, align='top_left'\)"),
    ("forward cache type", lambda: layer()(x(), cache={}), TypeError,
     r"cache must be a KVCache \(see new_cache\), got dict"),
    ("forward cache batch", lambda: (a := layer())(x(b=2), cache=a.new_cache(3, 8)), ValueError,
     r"the cache does not fit this call: it holds \(b, h_kv, d_h\) = \(3, 2, 4\), this layer writes "
     r"\(2, 2, 4\); make one with layer.new_cache\(batch_size=2, max_len=...\)"),
    ("forward cache overflow", lambda: (a := layer())(x(s=3), cache=a.new_cache(2, 2)), ValueError,
     r"cache overflow: 0 cached \+ 3 new > max_len=2; allocate a larger cache or reset\(\) it"),
    ("forward cache dtype", lambda: (a := layer())(x(), cache=a.new_cache(2, 8, dtype=torch.float64)), TypeError,
     "the cache holds torch.float64, this layer writes torch.float32 keys"),
    ("forward cache device", lambda: (a := layer())(x(), cache=a.new_cache(2, 8, device="meta")), ValueError,
     "the cache is on meta, this call runs on cpu"),
    ("forward cache with context", lambda: (a := layer())(x(), x(), cache=a.new_cache(2, 8)), ValueError,
     "cache= is for self-attention decoding; cross-attention keys need no cache"),
    ("forward cache mask", lambda: (lambda a: a(x(s=1), cache=filled_cache(a, 2, 8, 3),
                                                mask=torch.ones(2, 1, 1, 3, dtype=torch.bool)))(layer()), ValueError,
     r"mask of shape \(2, 1, 1, 3\) does not broadcast to \(b, h, s_q, s_kv\) = \(2, 4, 1, 4\)"),
    ("forward positions shape", lambda: rotary_layer()(x(), positions=torch.arange(5)), ValueError,
     r"positions must have shape \(s_q=3,\) or \(b=2, s_q=3\), got \(5,\)"),
    ("forward positions dtype", lambda: rotary_layer()(x(), positions=torch.arange(3.0)), TypeError,
     "positions must be an integer tensor, got torch.float32"),
    ("forward positions type", lambda: rotary_layer()(x(), positions=[0, 1, 2]), TypeError,
     "positions must be a torch.Tensor, got list"),
    ("forward positions device", lambda: rotary_layer()(x(), positions=torch.arange(3, device="meta")), ValueError,
     "positions are on meta, but the inputs are on cpu"),
    ("head positions device", lambda: rotary_layer().head(0)(x(), positions=torch.arange(3, device="meta")),
     ValueError, "positions are on meta, but the inputs are on cpu"),
    ("forward rotary cross", lambda: rotary_layer()(x(), x()), ValueError,
     "rotary embeddings apply to self-attention only; got context/key inputs"),
    # ---- head(), heads(), from_heads -------------------------------------------------------------------
    ("head index range", lambda: layer().head(4), IndexError, r"head index must be in \[0, 4\), got 4"),
    ("head index negative range", lambda: layer().head(-5), IndexError, r"head index must be in \[0, 4\), got -5"),
    ("head index type", lambda: layer().head("0"), TypeError, "head index must be an int, got str"),
    ("head index bool", lambda: layer().head(True), TypeError, "head index must be an int, got bool"),
    ("from_heads empty", lambda: MultiHeadAttention.from_heads([], out_proj=nn.Linear(16, 16)), TypeError,
     "from_heads needs a non-empty sequence of AttentionHead"),
    ("from_heads not heads", lambda: MultiHeadAttention.from_heads([nn.Linear(2, 2)], out_proj=nn.Linear(16, 16)),
     TypeError, "from_heads needs a non-empty sequence of AttentionHead"),
    ("from_heads out_proj type", lambda: MultiHeadAttention.from_heads(layer().heads(), out_proj=torch.eye(16)),
     TypeError, "out_proj must be an nn.Linear, got Tensor"),
    ("from_heads out_proj shape", lambda: MultiHeadAttention.from_heads(layer().heads(), out_proj=nn.Linear(8, 16)),
     ValueError, r"out_proj must map h \* d_head = 16 -> d_model = 16 \(weight \(16, 16\)\), got weight \(16, 8\)"),
    ("from_heads n_kv_heads", lambda: MultiHeadAttention.from_heads(layer().heads(), out_proj=nn.Linear(16, 16),
                                                                     n_kv_heads=3), ValueError,
     "n_kv_heads must be a positive int dividing the 4 heads given, got 3"),
    ("from_heads group differs", lambda: MultiHeadAttention.from_heads(head_pair_with_different_kv(),
                                                                        out_proj=nn.Linear(8, 16), n_kv_heads=1),
     ValueError, r"heads 0 and 1 share K/V head 0 \(n_kv_heads=1\) but their w_k differ; pass n_kv_heads=2"),
    ("from_heads shapes differ", lambda: MultiHeadAttention.from_heads(
        [layer().head(0), MultiHeadAttention(16, 2).head(0)], out_proj=nn.Linear(12, 16)), ValueError,
     r"head 1 has weight shapes \[\(16, 8\), \(16, 8\), \(16, 8\)\], head 0 has \[\(16, 4\), \(16, 4\), \(16, 4\)\]"),
    ("from_heads head device", lambda: MultiHeadAttention.from_heads(
        [layer().head(0), MultiHeadAttention(D, H, H_KV, device="meta").head(1)], out_proj=nn.Linear(8, 16)), TypeError,
     r"every head must share head 0's dtype and device \(torch.float32 on cpu\); head 1 is torch.float32 on meta"),
    ("from_heads head dtype", lambda: MultiHeadAttention.from_heads(
        [layer().head(0), layer(dtype=torch.float64).head(1)], out_proj=nn.Linear(8, 16)), TypeError,
     r"every head must share head 0's dtype and device \(torch.float32 on cpu\); head 1 is torch.float64 on cpu"),
    ("from_heads out_proj device", lambda: MultiHeadAttention.from_heads(
        layer().heads(), out_proj=nn.Linear(16, 16, device="meta")), TypeError,
     r"out_proj must share the heads' dtype and device \(torch.float32 on cpu\); out_proj.weight is torch.float32 "
     r"on meta"),
    ("from_heads out_proj dtype", lambda: MultiHeadAttention.from_heads(
        layer().heads(), out_proj=nn.Linear(16, 16, dtype=torch.float64)), TypeError,
     r"out_proj must share the heads' dtype and device \(torch.float32 on cpu\); out_proj.weight is torch.float64 "
     r"on cpu"),
    # ---- new_cache / KVCache ---------------------------------------------------------------------------
    ("new_cache batch", lambda: layer().new_cache(-1, 8), ValueError, "batch_size must be a non-negative int, got -1"),
    ("new_cache max_len", lambda: layer().new_cache(2, 0), ValueError, "max_len must be a positive int, got 0"),
    ("new_cache dtype", lambda: layer().new_cache(2, 8, dtype=torch.int32), TypeError,
     "cache dtype must be a floating torch.dtype, got torch.int32"),
    ("new_cache device string", lambda: layer().new_cache(2, 8, device="gpu0"), ValueError,
     r"device must be a torch.device or a string such as 'cpu' or 'cuda:0', got 'gpu0'"),
    ("KVCache n_kv_heads", lambda: KVCache(2, 8, 0, 4), ValueError, "n_kv_heads must be a positive int, got 0"),
    ("KVCache d_head type", lambda: KVCache(2, 8, 2, 4.0), ValueError, "d_head must be a positive int, got 4.0"),
    ("KVCache dtype type", lambda: KVCache(2, 8, 2, 4, dtype="float32"), TypeError,
     "cache dtype must be a floating torch.dtype, got 'float32'"),
    ("KVCache.update type", lambda: KVCache(2, 8, 2, 4).update([0], [0]), TypeError,
     "cache keys must be a torch.Tensor, got list"),
    ("KVCache.update rank", lambda: KVCache(2, 8, 2, 4).update(torch.randn(2, 3, 4), torch.randn(2, 3, 4)),
     ValueError, r"cache keys must have shape \(b=2, h_kv=2, s, d_h=4\), got \(2, 3, 4\)"),
    ("KVCache.update heads", lambda: KVCache(2, 8, 2, 4).update(torch.randn(2, 4, 3, 4), torch.randn(2, 4, 3, 4)),
     ValueError, r"cache keys must have shape \(b=2, h_kv=2, s, d_h=4\), got \(2, 4, 3, 4\)"),
    ("KVCache.update values shape", lambda: KVCache(2, 8, 2, 4).update(torch.randn(2, 2, 3, 4),
                                                                        torch.randn(2, 2, 3, 5)),
     ValueError, r"cache values must have shape \(b=2, h_kv=2, s, d_h=4\), got \(2, 2, 3, 5\)"),
    ("KVCache.update lengths", lambda: KVCache(2, 8, 2, 4).update(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 2, 4)),
     ValueError, "keys and values must have the same length, got 3 and 2"),
    ("KVCache.update dtype", lambda: KVCache(2, 8, 2, 4).update(torch.randn(2, 2, 3, 4).half(),
                                                                torch.randn(2, 2, 3, 4).half()),
     TypeError, "cache holds torch.float32, got keys of dtype torch.float16"),
    ("KVCache.update device", lambda: KVCache(2, 8, 2, 4).update(torch.randn(2, 2, 3, 4, device="meta"),
                                                                 torch.randn(2, 2, 3, 4, device="meta")),
     ValueError, "cache is on cpu, got keys on meta"),
    ("KVCache.update overflow", lambda: KVCache(2, 2, 2, 4).update(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)),
     ValueError, r"cache overflow: 0 cached \+ 3 new > max_len=2"),
    # ---- AttentionHead ---------------------------------------------------------------------------------
    ("head.init rank", lambda: AttentionHead(torch.randn(16), torch.randn(16, 4), torch.randn(16, 4)), ValueError,
     r"w_q must be a 2-D tensor \(d_in, d_head\), got \(16,\)"),
    ("head.init d_head", lambda: AttentionHead(torch.randn(16, 4), torch.randn(16, 4), torch.randn(16, 3)),
     ValueError, r"w_q, w_k, w_v must share d_head; got \(16, 4\), \(16, 4\), \(16, 3\)"),
    ("head.init partial bias", lambda: AttentionHead(torch.randn(16, 4), torch.randn(16, 4), torch.randn(16, 4),
                                                     torch.zeros(4)), ValueError,
     "pass all three biases b_q, b_k, b_v or none"),
    ("head.init bias shape", lambda: AttentionHead(torch.randn(16, 4), torch.randn(16, 4), torch.randn(16, 4),
                                                   torch.zeros(5), torch.zeros(4), torch.zeros(4)), ValueError,
     r"b_q must have shape \(d_head=4,\), got \(5,\)"),
    ("head.forward x width", lambda: layer().head(0)(x(d=8)), ValueError,
     r"x must have shape \(b, s, d_model=16\) or \(s, d_model=16\), got \(2, 3, 8\)"),
    ("head.forward x dtype", lambda: layer().head(0)(x().double()), TypeError,
     "x has dtype torch.float64 but the weights are torch.float32"),
    ("head.forward context batch", lambda: layer().head(0)(x(), x(b=3)), ValueError,
     "batch mismatch: x has b=2, context has b=3"),
    ("head.forward mask shape", lambda: layer().head(0)(x(), mask=torch.ones(4, 4, dtype=torch.bool)), ValueError,
     r"mask of shape \(4, 4\) does not broadcast to \(b, h, s_q, s_kv\) = \(2, 1, 3, 3\)"),
    ("head.forward causal string", lambda: layer().head(0)(x(), causal="bottom_right"), TypeError,
     "causal must be a bool"),
    ("head.forward positions", lambda: rotary_layer().head(0)(x(), positions=torch.arange(4)), ValueError,
     r"positions must have shape \(s_q=3,\) or \(b=2, s_q=3\), got \(4,\)"),
    ("head.w_q setter shape", lambda: set_head_weight((4, 16)), ValueError,
     r"w_q must have shape \(16, 4\), got \(4, 16\)"),
    ("head.w_o standalone", lambda: AttentionHead(torch.randn(16, 4), torch.randn(16, 4), torch.randn(16, 4)).w_o,
     ValueError, "a standalone head has no W_O; take heads from a layer with attn.head"),
    # ---- AttentionConfig -------------------------------------------------------------------------------
    ("config d_model type", lambda: AttentionConfig(d_model="16", n_heads=4), TypeError,
     r"d_model must be a positive int, got '16' \(str\)"),
    ("config d_model bool", lambda: AttentionConfig(d_model=True, n_heads=1), TypeError,
     r"d_model must be a positive int, got True \(bool\)"),
    ("config n_heads zero", lambda: AttentionConfig(d_model=16, n_heads=0), ValueError,
     "n_heads must be a positive int, got 0"),
    ("config dropout range", lambda: AttentionConfig(d_model=16, n_heads=4, dropout=1.0), ValueError,
     r"dropout must be in \[0, 1\), got 1.0"),
    ("config dropout type", lambda: AttentionConfig(d_model=16, n_heads=4, dropout="0.1"), TypeError,
     r"dropout must be a float in \[0, 1\), got '0.1'"),
    ("config scale", lambda: AttentionConfig(d_model=16, n_heads=4, scale=-1.0), ValueError,
     "scale must be a positive finite float or None, got -1.0"),
    ("config bias type", lambda: AttentionConfig(d_model=16, n_heads=4, bias="yes"), TypeError,
     "bias must be a bool, got 'yes'"),
    ("config kv_head_of", lambda: AttentionConfig(d_model=16, n_heads=4).kv_head_of(4), IndexError,
     r"head index must be in \[0, 4\), got 4"),
    # ---- masks -----------------------------------------------------------------------------------------
    ("causal_mask length", lambda: masks.causal_mask(-1), ValueError, "s_q must be a non-negative int, got -1"),
    ("causal_mask align", lambda: masks.causal_mask(3, 4, align="diagonal"), ValueError,
     r"align must be one of \('bottom_right', 'top_left'\), got 'diagonal'"),
    ("sliding_window_mask window", lambda: masks.sliding_window_mask(4, window=0), ValueError,
     "window must be a positive int, got 0"),
    ("padding_mask neither", lambda: masks.padding_mask(), ValueError,
     r"pass exactly one of keep= \(bool \(b, s_kv\)\) or lengths= \(with s_kv=\)"),
    ("padding_mask both", lambda: masks.padding_mask(torch.ones(2, 3, dtype=torch.bool), lengths=[1, 2]),
     ValueError, "pass exactly one of keep="),
    ("padding_mask keep dtype", lambda: masks.padding_mask(torch.ones(2, 3)), TypeError,
     r"keep must be a bool tensor of shape \(b, s_kv\), got \(2, 3\) torch.float32"),
    ("padding_mask keep rank", lambda: masks.padding_mask(torch.ones(3, dtype=torch.bool)), TypeError,
     r"keep must be a bool tensor of shape \(b, s_kv\), got \(3,\) torch.bool"),
    ("padding_mask lengths dtype", lambda: masks.padding_mask(lengths=[1.5, 2.0], s_kv=3), TypeError,
     r"lengths must be a 1-D integer sequence \(b,\), got \(2,\) torch.float32"),
    ("padding_mask lengths range", lambda: masks.padding_mask(lengths=[1, 4], s_kv=3), ValueError,
     r"lengths must lie in \[0, s_kv=3\], got \[1, 4\]"),
    ("padding_mask s_kv", lambda: masks.padding_mask(lengths=[1], s_kv=-2), ValueError,
     "s_kv must be a non-negative int, got -2"),
    ("combine_masks dtype", lambda: masks.combine_masks(torch.ones(3, 3, dtype=torch.int8)), TypeError,
     r"mask must be bool \(True = may attend\) or floating \(added to the scores\), got torch.int8"),
    ("combine_masks type", lambda: masks.combine_masks(masks.causal_mask(3), "causal"), TypeError,
     "mask must be a torch.Tensor"),
    ("combine_masks shapes", lambda: masks.combine_masks(masks.causal_mask(3), masks.causal_mask(4)), ValueError,
     r"masks of shapes \[\(3, 3\), \(4, 4\)\] do not broadcast together"),
    ("combine_masks devices", lambda: masks.combine_masks(masks.causal_mask(3), masks.causal_mask(3, device="meta")),
     ValueError, r"masks must be on one device, got \['cpu', 'meta'\]"),
    ("combine_masks out dtype", lambda: masks.combine_masks(masks.causal_mask(3), dtype=torch.int32), TypeError,
     r"dtype must be a floating torch.dtype \(the additive mask's\), got torch.int32"),
    ("validate_mask shape", lambda: masks.validate_mask(torch.ones(3, 3, 3, dtype=torch.bool), (4, 2, 3, 3),
                                                        torch.float32, torch.device("cpu")), ValueError,
     r"mask of shape \(3, 3, 3\) does not broadcast to \(b, h, s_q, s_kv\) = \(4, 2, 3, 3\)"),
    # ---- RotaryEmbedding -------------------------------------------------------------------------------
    ("rotary d_head type", lambda: RotaryEmbedding(8.0), TypeError, r"d_head must be an int, got 8.0 \(float\)"),
    ("rotary d_head value", lambda: RotaryEmbedding(0), ValueError, "d_head must be a positive int, got 0"),
    ("rotary rotary_dim odd", lambda: RotaryEmbedding(8, rotary_dim=3), ValueError,
     r"rotary_dim must be even and in \(0, d_head=8\], got 3"),
    ("rotary base", lambda: RotaryEmbedding(8, base=0.0), ValueError, "base must be positive, got 0.0"),
    ("rotary inv_freq", lambda: RotaryEmbedding(8, inv_freq=torch.ones(3)), ValueError,
     r"inv_freq must have shape \(4,\), got \(3,\)"),
    ("rotary forward positions", lambda: RotaryEmbedding(8)(torch.arange(3.0)), TypeError,
     r"positions must be an integer tensor of shape \(s,\) or \(b, s\), got \(3,\) torch.float32"),
    ("rotary rotate width", lambda: RotaryEmbedding(8).rotate(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4),
                                                              torch.arange(3)), ValueError,
     r"q must have shape \(b, heads, s, d_h=8\), got \(1, 2, 3, 4\)"),
    ("rotary rotate positions", lambda: RotaryEmbedding(8).rotate(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8),
                                                                  torch.arange(4)), ValueError,
     "positions give s=4 but q has s=3 and k has s=3"),
    # ---- functional ------------------------------------------------------------------------------------
    ("split_heads rank", lambda: hwf.split_heads(torch.randn(3, 8), 2), ValueError,
     r"split_heads expects a packed projection \(b, s, h \* d_h\), got \(3, 8\)"),
    ("split_heads n_heads", lambda: hwf.split_heads(torch.randn(1, 3, 8), 0), ValueError,
     "n_heads must be a positive int, got 0"),
    ("split_heads width", lambda: hwf.split_heads(torch.randn(1, 3, 8), 3), ValueError,
     "cannot split width 8 into n_heads=3 equal heads"),
    ("merge_heads rank", lambda: hwf.merge_heads(torch.randn(1, 3, 8)), ValueError,
     r"merge_heads expects split heads \(b, h, s, d_h\), got \(1, 3, 8\)"),
    ("attention backend", lambda: hwf.attention(*qkv(), backend="flash"), ValueError,
     r"backend must be one of \['eager', 'sdpa'\], got 'flash'"),
    ("attention q rank", lambda: hwf.attention(*qkv(q=(2, 3, 4))), ValueError,
     r"q must be a 4-D tensor \(b, h, s_q, d_h\), got \(2, 3, 4\)"),
    ("attention batch", lambda: hwf.attention(*qkv(q=(3, 4, 3, 4))), ValueError,
     r"q, k, v must share the batch size b; got q \(3, 4, 3, 4\), k \(2, 2, 5, 4\), v \(2, 2, 5, 4\)"),
    ("attention k/v", lambda: hwf.attention(*qkv(v=(2, 2, 6, 4))), ValueError,
     r"k and v must share \(b, h_kv, s_kv\); got q \(2, 4, 3, 4\), k \(2, 2, 5, 4\), v \(2, 2, 6, 4\)"),
    ("attention d_h", lambda: hwf.attention(*qkv(q=(2, 4, 3, 8))), ValueError, "q and k must share d_h"),
    ("attention groups", lambda: hwf.attention(*qkv(k=(2, 3, 5, 4))), ValueError,
     "query heads h=4 must be a multiple of K/V heads h_kv=3"),
    ("attention dtype", lambda: hwf.attention(*qkv(dtype=torch.float64)), TypeError,
     "q, k, v must share a dtype; got torch.float64, torch.float32, torch.float32"),
    ("attention causal", lambda: hwf.attention(*qkv(), causal="top_left"), TypeError, "causal must be a bool"),
    ("attention mask", lambda: hwf.attention(*qkv(), mask=torch.ones(3, 3, dtype=torch.bool)), ValueError,
     r"mask of shape \(3, 3\) does not broadcast to \(b, h, s_q, s_kv\) = \(2, 4, 3, 5\)"),
    # ---- explain_dispatch ------------------------------------------------------------------------------
    ("explain x width", lambda: layer().explain_dispatch(x(d=8)), ValueError,
     r"x must have shape \(b, s, d_model=16\) or \(s, d_model=16\), got \(2, 3, 8\)"),
    ("explain causal", lambda: layer().explain_dispatch(x(), causal=1), TypeError, r"causal must be a bool \(True = bottom-right aligned\), got 1"),
    ("explain cache type", lambda: layer().explain_dispatch(x(), cache=object()), TypeError,
     r"cache must be a KVCache \(see new_cache\), got object"),
    ("explain cache + context", lambda: (a := layer()).explain_dispatch(x(), context=x(), cache=a.new_cache(2, 4)),
     ValueError, "cache= is for self-attention decoding"),
    ("explain mask", lambda: layer().explain_dispatch(x(), mask=torch.ones(2, 2, dtype=torch.bool)), ValueError,
     r"mask of shape \(2, 2\) does not broadcast to \(b, h, s_q, s_kv\) = \(2, 4, 3, 3\)"),
    ("explain warn_bytes str", lambda: layer().explain_dispatch(x(), warn_bytes="1GB"), TypeError,
     r"warn_bytes must be None or an int \(bytes\), got str '1GB'"),
    ("explain warn_bytes bool", lambda: layer().explain_dispatch(x(), warn_bytes=True), TypeError,
     r"warn_bytes must be None or an int \(bytes\), got bool True"),
    ("explain warn_bytes negative", lambda: layer().explain_dispatch(x(), warn_bytes=-1), ValueError,
     r"warn_bytes must be None or a non-negative int \(bytes\), got -1"),
    # ---- walkthrough.walk ------------------------------------------------------------------------------
    ("walk kdim", lambda: walk(AttentionConfig(d_model=16, n_heads=4, kdim=8, vdim=8), seq_len=3), ValueError,
     r"walk: a self-attention walk needs kdim == vdim == d_model=16, got kdim=8, vdim=8"),
    ("walk dtype vs attn", lambda: walk((a := layer(dtype=torch.float64)).config, seq_len=3, attn=a,
                                        dtype=torch.float32), ValueError,
     r"walk: dtype=torch.float32, device=None do not match attn's weights \(torch.float64 on cpu\)"),
    # ---- checkpoints -----------------------------------------------------------------------------------
    ("load_state_dict other layout", lambda: MultiHeadAttention(16, 2).load_state_dict(
        MultiHeadAttention(16, 4).state_dict()), ValueError,
     r"state dict was saved from AttentionConfig\(d_model=16, n_heads=4, n_kv_heads=4, d_head=4.*but this layer "
     r"is AttentionConfig\(d_model=16, n_heads=2, n_kv_heads=2, d_head=8"),
]


@pytest.mark.parametrize("name, call, exc, message", CORE, ids=[c[0] for c in CORE])
def test_core_entry_points_refuse_bad_input(name, call, exc, message):
    with pytest.raises(exc) as info:
        call()
    assert type(info.value) is exc, f"{name}: raised {type(info.value).__name__}, expected {exc.__name__}"
    assert re.search(message, str(info.value)), f"{name}: message {str(info.value)!r} lacks {message!r}"


# ---- optional subpackages: rows run only where the subpackage (and its dependency) is installed ----------
def _interop():
    return pytest.importorskip("headwise.interop")


def _analysis():
    return pytest.importorskip("headwise.analysis")


def _hf():
    pytest.importorskip("transformers")
    return _interop()


CFG = AttentionConfig(d_model=64, n_heads=8)
HF_SUPPORTED = "headwise converts modules that call transformers' attention interface"

OPTIONAL = [
    ("interop.from_torch type", lambda: _interop().from_torch(nn.Linear(2, 2)), TypeError,
     "from_torch expects a torch.nn.MultiheadAttention, got Linear"),
    ("interop.from_torch add_bias_kv", lambda: _interop().from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True)),
     ValueError, r"headwise does not model these nn.MultiheadAttention features: add_bias_kv=True"),
    ("interop.to_torch type", lambda: _interop().to_torch(nn.Linear(2, 2)), TypeError,
     "to_torch expects a headwise MultiHeadAttention, got Linear"),
    ("interop.to_torch GQA", lambda: _interop().to_torch(MultiHeadAttention(16, 4, 2)), ValueError,
     r"cannot express this layer as nn.MultiheadAttention: GQA \(n_kv_heads=2 != n_heads=4\)"),
    ("interop.from_hf type", lambda: _hf().from_hf(nn.Linear(2, 2)), TypeError,
     "from_hf: Linear is not a supported attention module: " + HF_SUPPORTED),
    ("interop.to_hf attn", lambda: _hf().to_hf(nn.Linear(2, 2), like=nn.Linear(2, 2)), TypeError,
     "to_hf: attn must be a MultiHeadAttention, got Linear"),
    ("interop.patch type", lambda: _hf().patch("model"), TypeError, "patch: model must be a torch.nn.Module, got str"),
    ("interop.patch nothing", lambda: _hf().patch(nn.Sequential(nn.Linear(2, 2))), TypeError,
     r"patch: Sequential contains no attention module headwise can patch \(it patches every module that calls "
     "transformers' attention interface"),
    ("interop.unpatch type", lambda: _hf().unpatch(3), TypeError, "unpatch: model must be a torch.nn.Module, got int"),
    ("analysis.param_count config", lambda: _analysis().param_count({"d_model": 64}), TypeError,
     "config must be an AttentionConfig, got dict"),
    ("analysis.forward_flops seq_len", lambda: _analysis().forward_flops(CFG, 0), ValueError,
     "seq_len must be a positive int, got 0"),
    ("analysis.forward_flops batch", lambda: _analysis().forward_flops(CFG, 8, batch=1.5), ValueError,
     "batch must be a positive int, got 1.5"),
    ("analysis.kv_cache_bytes dtype", lambda: _analysis().kv_cache_bytes(CFG, 8, dtype="float13"), ValueError,
     r"dtype must be a torch.dtype or one of \[.*'float16'.*\], got 'float13'"),
    ("analysis.kv_cache_bytes seq_len", lambda: _analysis().kv_cache_bytes(CFG, -1), ValueError,
     "seq_len must be a positive int, got -1"),
    ("analysis.attention_memory kv_len", lambda: _analysis().attention_memory(CFG, 8, kv_len=-2), ValueError,
     "kv_len must be a positive int, got -2"),
    ("analysis.parse_dtype", lambda: _analysis().parse_dtype(3), ValueError, r"dtype must be a torch.dtype or one of"),
    ("analysis.summarize config", lambda: _analysis().summarize(None, 8), TypeError,
     "config must be an AttentionConfig, got NoneType"),
]


@pytest.mark.parametrize("name, call, exc, message", OPTIONAL, ids=[c[0] for c in OPTIONAL])
def test_optional_entry_points_refuse_bad_input(name, call, exc, message):
    test_core_entry_points_refuse_bad_input(name, call, exc, message)


LAYER = ["--d-model", "64", "--n-heads", "8"]
CLI = [
    ("cli unknown command", ["nope"], "argument COMMAND: invalid choice: 'nope'"),
    ("cli explain n_heads", ["explain", "--d-model", "10", "--n-heads", "3"],
     r"headwise explain: error: n_heads=3 does not divide d_model=10; head counts that do near 3: \[1, 2, 5, 10\]"),
    ("cli explain n_kv_heads", ["explain", *LAYER, "--n-kv-heads", "3"],
     r"headwise explain: error: n_kv_heads=3 does not divide n_heads=8; valid n_kv_heads: \[1, 2, 4, 8\]"),
    ("cli explain seq", ["explain", *LAYER, "--seq", "-1"], "headwise explain: error: --seq must be a positive integer, got -1"),
    ("cli explain dtype", ["explain", *LAYER, "--dtype", "float13"], "headwise explain: error: dtype must be a torch.dtype"),
    ("cli explain int", ["explain", "--d-model", "x"], "argument --d-model: invalid int value: 'x'"),
    ("cli explain preset", ["explain", "--preset", "nope"], "headwise explain: error: unknown preset 'nope'; known presets:"),
    ("cli compare preset", ["compare", "nope"], "headwise compare: error: unknown preset 'nope'"),
    ("cli tour seq", ["tour", "--seq", "-5"], "headwise tour: error: --seq must be a positive integer, got -5"),
    ("cli tour batch", ["tour", "--batch", "0"], "headwise tour: error: --batch must be a positive integer, got 0"),
    ("cli check target", ["check", "nomodule:factory"], "headwise check: error: cannot import module 'nomodule'"),
]


@pytest.mark.parametrize("name, argv, message", CLI, ids=[c[0] for c in CLI])
def test_cli_refuses_bad_input_with_exit_2(name, argv, message, capsys):
    cli = pytest.importorskip("headwise.cli")
    if argv[0] not in cli.SUBCOMMANDS and argv[0] != "nope":
        pytest.skip(f"subcommand {argv[0]!r} has not landed")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), f"{name}: stderr {err!r} lacks {message!r}"
    assert "Traceback" not in err
