"""Hypothesis fuzzing of every path against a float64 reference written here, from the formula, head by head.

Shapes (d_model, n_heads, n_kv_heads, d_head, batch incl. 0/1, lengths incl. 0/1), masks (bool, float,
padding, sliding window, causal flag, combinations, none), dtypes (float32, float64, bfloat16; float16 in
the extreme-value test), values (normal, scaled up to 1e4) and paths (sdpa, eager, return_weights,
head by head, cache decode, cross-attention). Every example is tiny; the example counts are explicit per
test (about 3,300 in all) and the whole file runs in well under a minute on one core. Weights keep
PyTorch's default init, so inputs scaled by 1e4 give logits of order 1e7 to 1e8.

Checked on every example: no NaN/inf wherever the reference is finite, and, at ordinary scales, agreement
with the reference within the tolerances listed in tests/TOLERANCES.md. At 100x and 1e4x scaled inputs the
softmax is (numerically) an argmax whose winner can flip on a rounding error in float32/bfloat16 scores,
so there only finiteness (and, in float64, agreement) is asserted.
"""

from __future__ import annotations

import math

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.reference import reference_mha
from headwise import MultiHeadAttention
from headwise import masks as hwm

DTYPES = [torch.float32, torch.float64, torch.bfloat16]
SCALES = [1.0, 1.0, 1.0, 100.0, 1e4]
TOL = {  # (rtol, atol) against the float64 reference at scale 1; see tests/TOLERANCES.md
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 2e-5),
    torch.bfloat16: (6e-2, 6e-2),
}


# ---------------------------------------------------------------------------------------------------------
# The reference: y = concat_h softmax(Q_h K_g^T * scale + mask) V_g  W_O + b_O, g = h // (n_heads / n_kv_heads)
# ---------------------------------------------------------------------------------------------------------
def reference(attn, x, context=None, mask=None, causal=False):
    """The shared float64 reference; ``reference.peak`` is the largest |q|, |k|, |v|, |y| it met."""
    out = reference_mha(attn, x, context, mask=mask, causal=causal)
    reference.peak = reference_mha.peak
    return out


# ---------------------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------------------
@st.composite
def layer_specs(draw):
    n_kv = draw(st.integers(1, 3))
    n_heads = n_kv * draw(st.integers(1, 3))
    if draw(st.booleans()):
        d_head = draw(st.integers(1, 4))
        d_model = draw(st.integers(1, 12))
        return dict(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv, d_head=d_head, bias=draw(st.booleans()))
    d_head = draw(st.integers(1, 3))
    return dict(d_model=n_heads * d_head, n_heads=n_heads, n_kv_heads=n_kv, bias=draw(st.booleans()))


_LAYERS: dict = {}


def build(spec, dtype, backend, seed):
    """One layer per (shape, dtype, backend, seed % 8), reused across examples: construction dominates the
    cost of a tiny example, and no test mutates a layer."""
    key = (tuple(sorted(spec.items())), dtype, backend, seed % 8)
    if key not in _LAYERS:
        torch.manual_seed(seed % 8)
        _LAYERS[key] = MultiHeadAttention(**spec, backend=backend).to(dtype).eval()
    return _LAYERS[key]


def draw_mask(draw, kind, b, h, s_q, s_kv, gen):
    if kind == "none":
        return None
    if kind == "bool":
        shape = (draw(st.sampled_from([1, b])), draw(st.sampled_from([1, h])), s_q, s_kv)
        return torch.rand(shape, generator=gen) < draw(st.sampled_from([0.2, 0.5, 0.9]))
    if kind == "float":
        shape = (draw(st.sampled_from([1, b])), 1, s_q, s_kv)
        vals = torch.randn(shape, generator=gen, dtype=torch.float64)
        return vals.masked_fill(torch.rand(shape, generator=gen) < 0.3, -math.inf)
    if kind == "padding":
        lengths = [draw(st.integers(0, s_kv)) for _ in range(b)]
        return hwm.padding_mask(lengths=torch.tensor(lengths, dtype=torch.long), s_kv=s_kv,
                                left=draw(st.booleans()))
    if kind == "sliding":
        return hwm.sliding_window_mask(s_q, s_kv, window=draw(st.integers(1, 3)),
                                       align=draw(st.sampled_from(hwm.ALIGNMENTS)))
    if kind == "padding+sliding":
        lengths = [draw(st.integers(0, s_kv)) for _ in range(b)]
        return hwm.combine_masks(hwm.padding_mask(lengths=lengths, s_kv=s_kv),
                                 hwm.sliding_window_mask(s_q, s_kv, window=2))
    raise AssertionError(kind)


MASK_KINDS = ["none", "bool", "float", "padding", "sliding", "padding+sliding"]


def cast_mask(mask, dtype):
    """What the layer does to a mask (floats are cast to the compute dtype), so the reference sees the same."""
    if mask is not None and mask.dtype.is_floating_point:
        return mask.to(dtype)
    return mask


def check(out, ref, dtype, scale, what):
    finite = torch.isfinite(ref)
    assert torch.isfinite(out[finite]).all(), f"{what}: non-finite output where the float64 reference is finite"
    if scale == 1.0 or dtype == torch.float64:
        rtol, atol = TOL[dtype]
        atol = atol * max(1.0, float(ref.abs().max()) if ref.numel() else 1.0)
        torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------
@settings(max_examples=1200)
@given(spec=layer_specs(), dtype=st.sampled_from(DTYPES), scale=st.sampled_from(SCALES),
       b=st.integers(0, 3), s=st.integers(0, 5), mask_kind=st.sampled_from(MASK_KINDS), causal=st.booleans(),
       path=st.sampled_from(["sdpa", "eager", "weights"]), seed=st.integers(0, 2**16), data=st.data())
def test_fuzz_self_attention(spec, dtype, scale, b, s, mask_kind, causal, path, seed, data):
    attn = build(spec, dtype, "eager" if path == "eager" else "sdpa", seed)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, s, spec["d_model"], generator=gen, dtype=torch.float64) * scale).to(dtype)
    mask = cast_mask(draw_mask(data.draw, mask_kind, b, spec["n_heads"], s, s, gen), dtype)
    ref_y, ref_w = reference(attn, x, mask=mask, causal=causal)
    if path == "weights":
        y, w = attn(x, mask=mask, causal=causal, return_weights=True)
        check(w, ref_w, dtype, scale, "weights")
    else:
        y = attn(x, mask=mask, causal=causal)
    assert y.dtype == dtype and y.shape == ref_y.shape
    check(y, ref_y, dtype, scale, path)


@settings(max_examples=500)
@given(spec=layer_specs(), dtype=st.sampled_from(DTYPES), scale=st.sampled_from(SCALES), b=st.integers(0, 3),
       s_q=st.integers(0, 4), s_kv=st.integers(0, 5), mask_kind=st.sampled_from(MASK_KINDS), causal=st.booleans(),
       backend=st.sampled_from(["sdpa", "eager"]), seed=st.integers(0, 2**16), data=st.data())
def test_fuzz_cross_attention(spec, dtype, scale, b, s_q, s_kv, mask_kind, causal, backend, seed, data):
    attn = build(spec, dtype, backend, seed)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, s_q, spec["d_model"], generator=gen, dtype=torch.float64) * scale).to(dtype)
    ctx = (torch.randn(b, s_kv, spec["d_model"], generator=gen, dtype=torch.float64) * scale).to(dtype)
    mask = cast_mask(draw_mask(data.draw, mask_kind, b, spec["n_heads"], s_q, s_kv, gen), dtype)
    ref_y, _ = reference(attn, x, ctx, mask=mask, causal=causal)
    check(attn(x, ctx, mask=mask, causal=causal), ref_y, dtype, scale, f"cross/{backend}")


@settings(max_examples=500)
@given(spec=layer_specs(), dtype=st.sampled_from(DTYPES), scale=st.sampled_from(SCALES), b=st.integers(0, 3),
       s=st.integers(0, 5), mask_kind=st.sampled_from(MASK_KINDS), causal=st.booleans(), cross=st.booleans(),
       seed=st.integers(0, 2**16), data=st.data())
def test_fuzz_head_by_head(spec, dtype, scale, b, s, mask_kind, causal, cross, seed, data):
    attn = build(spec, dtype, "sdpa", seed)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, s, spec["d_model"], generator=gen, dtype=torch.float64) * scale).to(dtype)
    ctx = (torch.randn(b, s + 1, spec["d_model"], generator=gen, dtype=torch.float64) * scale).to(dtype) if cross else None
    s_kv = s + 1 if cross else s
    mask = cast_mask(draw_mask(data.draw, mask_kind, b, spec["n_heads"], s, s_kv, gen), dtype)
    ref_y, ref_w = reference(attn, x, ctx, mask=mask, causal=causal)
    total = None
    for i, head in enumerate(attn.heads()):
        z, w = head(x, ctx, mask=mask, causal=causal, return_weights=True)  # (b, s, d_h), (b, s, s_kv)
        check(w, ref_w[:, i], dtype, scale, f"head {i} weights")
        part = z.double() @ head.w_o.double()
        total = part if total is None else total + part
    if attn.out_proj.bias is not None:
        total = total + attn.out_proj.bias.double()
    # the sum is taken in float64 here, so compare against the same tolerance as the layer
    check(total, ref_y, dtype, scale, "sum of heads")


@settings(max_examples=500)
@given(spec=layer_specs(), dtype=st.sampled_from(DTYPES), scale=st.sampled_from(SCALES), b=st.integers(0, 2),
       prefill=st.integers(0, 3), steps=st.integers(1, 3), padded=st.booleans(),
       backend=st.sampled_from(["sdpa", "eager"]), seed=st.integers(0, 2**16), data=st.data())
def test_fuzz_cache_decode(spec, dtype, scale, b, prefill, steps, padded, backend, seed, data):
    attn = build(spec, dtype, backend, seed)
    gen = torch.Generator().manual_seed(seed)
    total = prefill + steps
    x = (torch.randn(b, total, spec["d_model"], generator=gen, dtype=torch.float64) * scale).to(dtype)
    keep = None
    if padded:  # left padding, as in batched generation
        lengths = [data.draw(st.integers(0, total)) for _ in range(b)]
        keep = hwm.padding_mask(lengths=torch.tensor(lengths, dtype=torch.long), s_kv=total, left=True)
    ref_y, _ = reference(attn, x, mask=keep, causal=True)
    cache = attn.new_cache(b, total + 1)
    outs = [attn(x[:, :prefill], cache=cache, mask=None if keep is None else keep[..., :prefill])]
    for t in range(prefill, total):
        outs.append(attn(x[:, t:t + 1], cache=cache, mask=None if keep is None else keep[..., :t + 1]))
    assert cache.length == total
    check(torch.cat(outs, 1), ref_y, dtype, scale, f"cache/{backend}")


@settings(max_examples=600)
@given(spec=layer_specs(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       b=st.integers(1, 2), s_q=st.integers(1, 4), s_kv=st.integers(1, 4), mask_kind=st.sampled_from(MASK_KINDS),
       causal=st.booleans(), path=st.sampled_from(["sdpa", "eager", "weights", "head", "cache", "cross"]),
       seed=st.integers(0, 2**16), data=st.data())
def test_fuzz_extreme_values_stay_finite(spec, dtype, b, s_q, s_kv, mask_kind, causal, path, seed, data):
    """Inputs of magnitude ~1e4 (logits ~1e8 with unit weights): never inf/NaN where float64 is finite."""
    attn = build(spec, dtype, "eager" if path == "eager" else "sdpa", seed)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, s_q, spec["d_model"], generator=gen, dtype=torch.float64) * 1e4).to(dtype)
    ctx = (torch.randn(b, s_kv, spec["d_model"], generator=gen, dtype=torch.float64) * 1e4).to(dtype)
    if path != "cross":
        ctx, s_kv = None, s_q
    mask = None if path == "cache" else cast_mask(
        draw_mask(data.draw, mask_kind, b, spec["n_heads"], s_q, s_kv, gen), dtype)
    causal = True if path == "cache" else causal
    ref_y, ref_w = reference(attn, x, ctx, mask=mask, causal=causal)
    # Projections or outputs beyond the dtype's range (float16 at 1e4 can get there) are a storage limit,
    # not an attention one: the guarantee is about the scores, which reach ~1e8 here.
    assume(reference.peak < torch.finfo(dtype).max / 4)
    if path == "weights":
        y, w = attn(x, mask=mask, causal=causal, return_weights=True)
        check(w, ref_w, dtype, 1e4, "weights")
    elif path == "head":
        outs = [h(x, mask=mask, causal=causal) for h in attn.heads()]
        y = attn.out_proj(torch.cat(outs, -1))
    elif path == "cache":
        cache = attn.new_cache(b, s_q)
        y = torch.cat([attn(x[:, :1], cache=cache)] + [attn(x[:, t:t + 1], cache=cache) for t in range(1, s_q)], 1)
    else:
        y = attn(x, ctx, mask=mask, causal=causal)
    check(y, ref_y, dtype, 1e4, path)
