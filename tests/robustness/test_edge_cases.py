"""The guarantees of docs/guarantees.md, one test (or one parametrized family) per row.

Paths: "sdpa" (fused default), "eager" (backend="eager"), "weights" (return_weights=True), "head" (every
head alone through attn.head(i), then W_O), "cache" (prefill + one-token decode steps), "cross"
(context of another length).
"""

from __future__ import annotations

import math

import pytest
import torch

from headwise import MultiHeadAttention
from headwise import functional as hwf
from headwise import masks as hwm
from tests.reference import reference_mha as reference

D, H, H_KV = 16, 4, 2
PATHS = ["sdpa", "eager", "weights", "head", "cache"]


def make(backend="sdpa", bias=False, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    return MultiHeadAttention(D, H, H_KV, bias=bias, backend=backend, **kw).to(dtype).eval()


def run(path, attn, x, context=None, mask=None, causal=False):
    """The layer's output (b, s_q, d) along one path. For "cache": prefill 1 token, then decode one by one,
    slicing a (b, 1, 1, s) key mask to the positions cached so far (the cache path is always causal)."""
    if path == "weights":
        return attn(x, context, mask=mask, causal=causal, return_weights=True)[0]
    if path == "head":
        z = torch.cat([h(x, context, mask=mask, causal=causal) for h in attn.heads()], dim=-1)
        return attn.out_proj(z)
    if path == "cache":
        assert context is None
        b, s, _ = x.shape
        cache = attn.new_cache(b, max(s, 1))
        cut = (lambda n: None) if mask is None else (lambda n: mask[..., :n])
        outs = [attn(x[:, :1], cache=cache, mask=cut(1))]
        outs += [attn(x[:, t:t + 1], cache=cache, mask=cut(t + 1)) for t in range(1, s)]
        return torch.cat(outs, dim=1)[:, :s]
    return attn(x, context, mask=mask, causal=causal)


def backend_of(path):
    return "eager" if path == "eager" else "sdpa"


# ---- fully masked rows ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("path", ["sdpa", "eager", "weights", "head"])
def test_fully_masked_rows_give_zeros(path, kind):
    attn = make(backend_of(path))  # no biases: a zero context is a zero output
    x = torch.randn(2, 4, D)
    allowed = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    allowed[0, :, 1] = False  # query 1 of batch 0 may read nothing
    allowed[1, :, 3] = False
    mask = allowed if kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, -math.inf)
    y = run(path, attn, x, mask=mask)
    assert torch.equal(y[0, 1], torch.zeros(D)) and torch.equal(y[1, 3], torch.zeros(D))
    torch.testing.assert_close(y.double(), reference(attn, x, mask=mask)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_fully_masked_rows_give_zero_weights(backend):
    attn = make(backend)
    allowed = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    allowed[..., 2, :] = False
    _, w = attn(torch.randn(1, 3, D), mask=allowed, return_weights=True)
    assert torch.equal(w[:, :, 2], torch.zeros(1, H, 3))
    torch.testing.assert_close(w[:, :, :2].sum(-1), torch.ones(1, H, 2))


def test_fully_masked_rows_give_zeros_in_cache_decode():
    """Left padding with a sequence of length 0: its decode steps read nothing they may read -> zeros."""
    for backend in ("sdpa", "eager"):
        attn = make(backend)
        x = torch.randn(2, 4, D)
        keep = hwm.padding_mask(lengths=[4, 0], s_kv=4, left=True)  # batch 1 is all padding
        y = run("cache", attn, x, mask=keep)
        assert torch.equal(y[1], torch.zeros(4, D))
        torch.testing.assert_close(y.double(), reference(attn, x, mask=keep, causal=True)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", ["sdpa", "eager", "weights", "head"])
def test_causal_queries_before_the_first_key_give_zeros(path):
    """Bottom-right causal with s_q > s_kv: the first s_q - s_kv queries precede every key."""
    attn = make(backend_of(path))
    x, ctx = torch.randn(2, 5, D), torch.randn(2, 2, D)
    y = run(path, attn, x, ctx, causal=True)
    assert torch.equal(y[:, :3], torch.zeros(2, 3, D))
    torch.testing.assert_close(y.double(), reference(attn, x, ctx, causal=True)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_finite_large_negative_mask_is_not_a_block(backend):
    """A row masked with finfo.min (Hugging Face's convention) is finite: it averages V uniformly, on
    every backend alike; only -inf (or False) blocks. This is the documented difference."""
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    mask = torch.zeros(1, 1, 3, 3)
    mask[..., 0, :] = torch.finfo(torch.float32).min
    out, _ = hwf.attention(q, k, v, mask=mask, backend=backend)
    torch.testing.assert_close(out[:, :, 0], v.mean(-2))


# ---- empty sequences and batch 0 ------------------------------------------------------------------------
EMPTY = {"b=0": (0, 3, 3), "s_q=0": (2, 0, 3), "s_kv=0": (2, 3, 0), "all=0": (0, 0, 0)}


EMPTY_CASES = [(path, case) for path in ["sdpa", "eager", "weights", "head", "cross"] for case in EMPTY
               if path == "cross" or EMPTY[case][1] == EMPTY[case][2]]  # self-attention has s_kv == s_q


@pytest.mark.parametrize("path, case", EMPTY_CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_empty_inputs_give_empty_or_zero_outputs(path, case, causal):
    b, s_q, s_kv = EMPTY[case]
    attn = make(backend_of(path), bias=True)
    x = torch.randn(b, s_q, D)
    ctx = torch.randn(b, s_kv, D) if path == "cross" else None
    mask = hwm.padding_mask(lengths=[s_kv] * b, s_kv=s_kv)
    for m in (None, mask):
        y = run("sdpa" if path == "cross" else path, attn, x, ctx, mask=m, causal=causal)
        assert y.shape == (b, s_q, D)
        # nothing to read: the context is zero and the output is the output bias alone
        torch.testing.assert_close(y, attn.out_proj.bias.expand(b, s_q, D) if s_kv == 0 else y)
        assert torch.isfinite(y).all()
    if path == "weights":
        assert attn(x, ctx, return_weights=True)[1].shape == (b, H, s_q, s_kv)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("b, s", [(0, 3), (2, 0), (0, 0)])
def test_empty_inputs_through_a_cache(backend, b, s):
    attn = make(backend, bias=True)
    cache = attn.new_cache(b, 4)
    y = attn(torch.randn(b, s, D), cache=cache)
    assert y.shape == (b, s, D) and cache.length == s
    y2 = attn(torch.randn(b, 1, D), cache=cache)  # decoding continues after an empty step
    assert y2.shape == (b, 1, D) and cache.length == s + 1


def test_empty_unbatched_input():
    attn = make()
    assert attn(torch.randn(0, D)).shape == (0, D)
    assert attn.head(0)(torch.randn(0, D)).shape == (0, D // H)


# ---- causal alignment -----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["sdpa", "eager", "weights", "head"])
@pytest.mark.parametrize("s_q, s_kv", [(2, 5), (5, 2), (4, 4), (1, 4)])
def test_causal_is_bottom_right_aligned(path, s_q, s_kv):
    attn = make(backend_of(path))
    x, ctx = torch.randn(2, s_q, D), torch.randn(2, s_kv, D)
    y = run(path, attn, x, ctx, causal=True)
    bottom_right = run(path, attn, x, ctx, mask=hwm.causal_mask(s_q, s_kv, align="bottom_right"))
    torch.testing.assert_close(y, bottom_right)
    torch.testing.assert_close(y.double(), reference(attn, x, ctx, causal=True)[0], rtol=1e-4, atol=1e-5)
    top_left = run(path, attn, x, ctx, mask=hwm.causal_mask(s_q, s_kv, align="top_left"))
    assert torch.allclose(y, top_left) == (s_q == s_kv)  # the two alignments differ exactly when s_q != s_kv


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_cache_decoding_sees_every_cached_position(backend):
    attn = make(backend)
    x = torch.randn(2, 6, D)
    cache = attn.new_cache(2, 6)
    attn(x[:, :5], cache=cache)
    y, w = attn(x[:, 5:], cache=cache, return_weights=True)
    assert w.shape == (2, H, 1, 6) and (w > 0).all()  # the new token reads all 5 cached positions and itself
    torch.testing.assert_close(y, attn(x, causal=True)[:, 5:])


# ---- extreme logits -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", PATHS + ["cross"])
@pytest.mark.parametrize("masked", [False, True])
def test_extreme_logits_stay_finite(path, dtype, masked):
    """Inputs scaled to 1e4 make logits of order 1e7: no inf/NaN where the float64 reference is finite,
    and weights still sum to one per row."""
    attn = make(backend_of(path), bias=True, dtype=dtype)
    x = (torch.randn(2, 5, D) * 1e4).to(dtype)
    ctx = (torch.randn(2, 3, D) * 1e4).to(dtype) if path == "cross" else None
    mask = hwm.padding_mask(lengths=[5 if ctx is None else 3, 2], s_kv=5 if ctx is None else 3) if masked else None
    causal = path != "cross"
    ref, _ = reference(attn, x, ctx, mask=mask, causal=causal)
    assert torch.isfinite(ref).all()
    y = run("sdpa" if path == "cross" else path, attn, x, ctx, mask=mask, causal=causal)
    assert torch.isfinite(y).all(), f"{path}/{dtype}: non-finite output"
    if path == "weights":
        _, w = attn(x, mask=mask, causal=causal, return_weights=True)
        torch.testing.assert_close(w.float().sum(-1), torch.ones(2, H, 5), rtol=0, atol=1e-2)


def test_extreme_logits_in_float32_match_the_reference_where_unambiguous():
    """With one dominant key per row (distinct, well separated logits), 1e4-scaled float32 equals float64."""
    attn = make(bias=False)
    x = torch.randn(1, 4, D, dtype=torch.float64)
    x32 = (x * 1e4).float()
    ref, w = reference(attn, x32, causal=True)
    assert (w.amax(-1) > 1 - 1e-6).all()  # every row is (numerically) one-hot in float64
    torch.testing.assert_close(attn(x32, causal=True).double(), ref, rtol=1e-4, atol=1e-3 * float(ref.abs().max()))


# ---- NaN isolation --------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS + ["cross"])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "causal"])
def test_nan_in_one_batch_element_never_leaks(path, mask_kind):
    attn = make(backend_of(path), bias=True)
    clean = torch.randn(3, 4, D)
    ctx_clean = torch.randn(3, 5, D) if path == "cross" else None
    dirty = clean.clone()
    ctx_dirty = None if ctx_clean is None else ctx_clean.clone()
    if ctx_dirty is None:
        dirty[1, 2, 3] = float("nan")
    else:
        ctx_dirty[1, 0, 0] = float("nan")
    s_kv = 4 if ctx_clean is None else 5
    mask = hwm.padding_mask(lengths=[s_kv, 2, 3], s_kv=s_kv) if mask_kind == "padding" else None
    causal = mask_kind == "causal"
    p = "sdpa" if path == "cross" else path
    y_dirty = run(p, attn, dirty, ctx_dirty, mask=mask, causal=causal)
    y_clean = run(p, attn, clean, ctx_clean, mask=mask, causal=causal)
    assert torch.isnan(y_dirty[1]).any()
    for i in (0, 2):
        assert not torch.isnan(y_dirty[i]).any()
        torch.testing.assert_close(y_dirty[i], y_clean[i])


# ---- determinism ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["eager", "weights", "head"])
def test_eager_path_is_bitwise_deterministic(path):
    attn = make("eager", bias=True)
    x = torch.randn(3, 7, D)
    mask = hwm.padding_mask(lengths=[7, 3, 5], s_kv=7)
    first = run(path, attn, x, mask=mask, causal=True)
    for _ in range(3):
        assert torch.equal(run(path, attn, x, mask=mask, causal=True), first)
    if path == "weights":
        w1 = attn(x, mask=mask, return_weights=True)[1]
        assert torch.equal(attn(x, mask=mask, return_weights=True)[1], w1)


@pytest.mark.parametrize("seq_len", [1, 3])
def test_walk_runs_in_the_given_layers_dtype_and_words_the_merge_by_its_kind(seq_len):
    from headwise.walkthrough import walk

    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, 2, dtype=torch.float64)
    steps = {s.name: s for s in walk(attn.config, seq_len=seq_len, batch=2, attn=attn)}
    x = torch.randn(2, seq_len, 16, dtype=torch.float64)
    assert steps["y = concat W_O"].shape == tuple(attn(x).shape)
    # Plain torch says whether the merge can be a view: the transposed context is contiguous only when s = 1
    ctx_t = torch.empty(2, 4, seq_len, 4).transpose(1, 2)
    merge = steps["merge: flatten heads"]
    assert merge.kind == ("view" if ctx_t.is_contiguous() else "new")
    assert merge.note.startswith("a view" if merge.kind == "view" else "a copy")
