"""The functional core: split/merge are views/inverses, and the classic flatten bug is caught."""

from __future__ import annotations

import warnings

import pytest
import torch
import numpy as np
import torch.nn.functional as F

from headwise.functional import attention, merge_heads, split_heads, split_qkv
from headwise.masks import causal_mask
from headwise import AttentionConfig, AttentionHead, KVCache, MaterializationWarning, MultiHeadAttention
from headwise import RotaryEmbedding
from headwise import functional as hwf
from headwise.plan import plan_attention
from tests.reference import reference_heads
from headwise import masks as hwm


def eager_attention(q, k, v, **kw):
    return attention(q, k, v, backend="eager", **kw)


def sdpa_attention(q, k, v, **kw):
    return attention(q, k, v, backend="sdpa", **kw)


def test_split_is_a_view_and_merge_inverts_it():
    x = torch.randn(2, 5, 12)
    heads = split_heads(x, 3)
    assert heads.shape == (2, 3, 5, 4) and heads._base is x
    assert torch.equal(heads[1, 2, 3], x[1, 3, 8:12])
    assert torch.equal(merge_heads(heads), x)


def test_flatten_without_transpose_is_a_different_tensor_of_the_same_shape():
    ctx = torch.randn(2, 3, 5, 4)
    wrong = ctx.reshape(2, 5, 12)
    assert wrong.shape == merge_heads(ctx).shape
    assert not torch.equal(wrong, merge_heads(ctx))


def test_split_rejects_a_width_that_does_not_divide():
    with pytest.raises(ValueError, match="cannot split width 10 into n_heads=3"):
        split_heads(torch.randn(1, 2, 10), 3)


@pytest.mark.parametrize("s_q, s_kv", [(4, 4), (1, 6), (3, 6), (6, 3)])
def test_causal_is_bottom_right_on_both_backends(s_q, s_kv):
    q = torch.randn(2, 4, s_q, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, s_kv, 8, dtype=torch.float64), torch.randn(2, 2, s_kv, 8, dtype=torch.float64)
    explicit = causal_mask(s_q, s_kv, align="bottom_right")
    ref, w = eager_attention(q, k, v, mask=explicit)
    torch.testing.assert_close(eager_attention(q, k, v, causal=True)[0], ref)
    torch.testing.assert_close(sdpa_attention(q, k, v, causal=True)[0], ref)
    if s_q > s_kv:  # the first queries sit before every key: they read nothing and return zeros
        assert torch.equal(ref[:, :, : s_q - s_kv], torch.zeros_like(ref[:, :, : s_q - s_kv]))


def test_empty_inputs_give_empty_or_zero_outputs():
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 0, 8)
    for backend in ("sdpa", "eager"):
        out, _ = attention(q, k, k, backend=backend)
        assert torch.equal(out, torch.zeros(2, 4, 3, 8))
    with pytest.raises(ValueError, match=r"backend must be one of \['eager', 'sdpa'\], got 'flash'"):
        attention(q, q, q, backend="flash")


def test_eager_half_precision_does_not_overflow():
    q = torch.full((1, 1, 2, 64), 40.0, dtype=torch.float16)  # q.k = 102400 > float16 max 65504
    out, w = eager_attention(q, q, torch.randn(1, 1, 2, 64, dtype=torch.float16))
    assert torch.isfinite(out).all() and torch.isfinite(w).all()


@pytest.mark.parametrize("h, h_kv", [(4, 4), (8, 2), (6, 1)])
def test_split_qkv_gives_the_views_of_splitting_q_k_v_apart_first(h, h_kv):
    d_h = 5
    qkv = torch.randn(2, 7, (h + 2 * h_kv) * d_h)
    q, k, v = split_qkv(qkv, h, h_kv)
    parts = qkv.split([h * d_h, h_kv * d_h, h_kv * d_h], dim=-1)
    for got, part, n in zip((q, k, v), parts, (h, h_kv, h_kv)):
        want = split_heads(part, n)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got.stride() == want.stride() and got.data_ptr() == want.data_ptr()  # views, never copies


def test_split_qkv_refuses_widths_that_are_not_whole_heads():
    with pytest.raises(ValueError, match="cannot split width 30 into n_heads=4"):
        split_qkv(torch.randn(1, 2, 30), 2, 1)
    with pytest.raises(ValueError, match="n_kv_heads must be a positive int"):
        split_qkv(torch.randn(1, 2, 32), 4, 0)
    # a bad query-head count is named too (before, -1 + 2 * 2 = 3 heads split and torch raised later)
    for bad in (-1, 0, True, 2.0):
        with pytest.raises(ValueError, match="n_heads must be a positive int"):
            split_qkv(torch.randn(1, 2, 24), bad, 2)


_PLAN_FORWARD = MultiHeadAttention.forward.__globals__["plan_forward"]
PLAN = _PLAN_FORWARD.__globals__["plan_attention"].__globals__


def test_functional_attention_refuses_int_masks_and_string_causal():
    q = k = v = torch.randn(1, 2, 3, 4)
    for backend in ("sdpa", "eager"):
        with pytest.raises(TypeError, match="mask must be bool"):
            hwf.attention(q, k, v, mask=torch.ones(3, 3, dtype=torch.int64), backend=backend)
        with pytest.raises(TypeError, match="causal must be a bool"):
            hwf.attention(q, k, v, causal="top_left", backend=backend)
    with pytest.raises(TypeError, match="return_weights must be a bool"):
        hwf.attention(q, k, v, return_weights="no")
    with pytest.raises(ValueError, match="dropout must be in"):
        hwf.attention(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 10{400}$"):  # an int beyond any float
        hwf.attention(q, k, v, dropout_p=10**400)
    with pytest.raises(ValueError, match="scale must be a positive finite float"):
        hwf.attention(q, k, v, scale=float("nan"))


def test_the_public_names_are_the_documented_ones():
    assert set(hwf.__all__) == {"split_heads", "split_qkv", "merge_heads", "attention",
                                "attend", "softmax_attention", "available_backends"}


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("case", ["causal", "mask", "decode"])
def test_attention_matches_the_float64_reference(backend, case):
    torch.manual_seed(0)
    s_q = 1 if case == "decode" else 5
    q, k, v = torch.randn(2, 6, s_q, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 3)
    mask = torch.rand(2, 1, s_q, 5) > 0.3 if case == "mask" else None
    if mask is not None:
        mask[..., 0] = True  # every row reads something
    causal = case == "causal"
    got, weights = hwf.attention(q, k, v, mask=mask, causal=causal, backend=backend,
                                 return_weights=backend == "eager")
    ref_z, ref_w = reference_heads(q, k, v, mask=mask, causal=causal)
    torch.testing.assert_close(got.double(), ref_z, rtol=1e-4, atol=1e-5)
    if backend == "eager":
        torch.testing.assert_close(weights.double(), ref_w, rtol=1e-4, atol=1e-5)


def test_attend_refuses_an_integer_mask_instead_of_adding_it():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    plan = plan_attention(h=2, h_kv=2, d_h=4, scale=0.5, b=1, s_q=3, s_kv=3, dtype=q.dtype, device=q.device,
                          has_mask=True)
    with pytest.raises(TypeError, match="mask must be bool .* or floating .*, got torch.int64"):
        hwf.attend(plan, q, k, v, torch.ones(1, 1, 3, 3, dtype=torch.int64))



@pytest.mark.parametrize("plan", ["x", None, (1, 2, 3, 3)])
def test_attend_refuses_what_is_not_a_plan(plan):
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(TypeError, match=f"plan must be a headwise.plan.Plan .*got {type(plan).__name__}"):
        hwf.attend(plan, q, q, q)


def _qkv(b=2, h=4, h_kv=2, s_q=5, s_kv=6, d_h=8, d_v=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, s_q, d_h, generator=g, dtype=dtype), torch.randn(b, h_kv, s_kv, d_h, generator=g, dtype=dtype),
            torch.randn(b, h_kv, s_kv, d_v, generator=g, dtype=dtype))


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("causal", [False, True])
def test_values_of_their_own_width_match_the_reference(backend, causal):
    q, k, v = _qkv(d_h=12, d_v=8)  # DeepSeek's MLA: d_qk 192, d_v 128
    z, _ = hwf.attention(q, k, v, causal=causal, backend=backend)
    ref, _ = reference_heads(q, k, v, causal=causal)
    assert z.shape == (2, 4, 5, 8)
    torch.testing.assert_close(z, ref)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_softcap_matches_the_reference_and_bounds_the_scores(mask_kind):
    q, k, v = _qkv()
    q = q * 10  # scores far beyond the cap
    mask = {None: None, "bool": torch.rand(5, 6, generator=torch.Generator().manual_seed(1)) > 0.3,
            "float": torch.randn(2, 1, 5, 6, dtype=torch.float64)}[mask_kind]
    z, w = hwf.attention(q, k, v, mask=mask, softcap=3.0, return_weights=True)
    ref_z, ref_w = reference_heads(q, k, v, mask=mask, softcap=3.0)
    torch.testing.assert_close(z, ref_z)
    torch.testing.assert_close(w, ref_w)
    uncapped, _ = hwf.attention(q, k, v, mask=mask)
    assert (uncapped - z).abs().max() > 1e-2  # the cap changes the answer: this test can fail


@pytest.mark.parametrize("causal", [False, True])
def test_sinks_take_probability_and_carry_no_value(causal):
    q, k, v = _qkv()
    sinks = torch.tensor([0.0, 2.0, -1.0, 5.0], dtype=torch.float64)
    z, w = hwf.attention(q, k, v, sinks=sinks, causal=causal, return_weights=True)
    ref_z, ref_w = reference_heads(q, k, v, sinks=sinks, causal=causal)
    torch.testing.assert_close(z, ref_z)
    torch.testing.assert_close(w, ref_w)
    assert (w.sum(-1) < 1 - 1e-6).all()  # every row gave some probability to its sink


@pytest.mark.parametrize("shape", [(2, 4, 5, 1), (1, 4, 5, 1), (2, 4, 1, 1)])
def test_sinks_per_query_row_match_the_reference(shape):
    q, k, v = _qkv()
    sinks = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 2
    mask = torch.rand(5, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    z, w = hwf.attention(q, k, v, sinks=sinks, mask=mask, return_weights=True)
    ref_z, ref_w = reference_heads(q, k, v, sinks=sinks, mask=mask)
    torch.testing.assert_close(z, ref_z)
    torch.testing.assert_close(w, ref_w)
    per_head, _ = hwf.attention(q, k, v, sinks=sinks[0, :, 0, 0], mask=mask)
    assert (per_head - z).abs().max() > 1e-3  # the rows' own sinks change the answer: this test can fail


def test_sinks_and_softcap_are_differentiable_and_refuse_bad_values():
    q, k, v = _qkv()
    sinks = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    z, _ = hwf.attention(q, k, v, sinks=sinks, softcap=5.0)
    z.sum().backward()
    assert sinks.grad is not None and torch.isfinite(sinks.grad).all()
    with pytest.raises(ValueError, match=r"sinks must be a floating tensor of shape \(h=4,\) or \(b or 1, h=4, "
                                         r"s_q or 1, 1\) with b=2, s_q=5, got \(3,\)"):
        hwf.attention(q, k, v, sinks=torch.zeros(3, dtype=torch.float64))
    for bad in ((2, 1, 5, 1), (3, 4, 5, 1), (2, 4, 4, 1), (2, 4, 5, 2), (4, 5, 1)):  # never across heads
        with pytest.raises(ValueError, match="sinks must be a floating tensor of shape"):
            hwf.attention(q, k, v, sinks=torch.zeros(bad, dtype=torch.float64))
    rows = torch.zeros(2, 4, 5, 1, dtype=torch.float64, requires_grad=True)
    hwf.attention(q, k, v, sinks=rows)[0].sum().backward()
    assert rows.grad is not None and torch.isfinite(rows.grad).all()
    with pytest.raises(ValueError, match="softcap must be a positive finite float or None, got nan"):
        hwf.attention(q, k, v, softcap=float("nan"))
    with pytest.raises(TypeError, match="softcap must be a float or None, got '3'"):
        hwf.attention(q, k, v, softcap="3")


@pytest.mark.parametrize("h_kv", [1, 2])
@pytest.mark.parametrize("s_q", [1, 5])
def test_the_eager_path_multiplies_grouped_values_the_same_way_when_traced(monkeypatch, h_kv, s_q):
    # Traced code multiplies probabilities and values with an einsum (it keeps export's sequence length free),
    # eager code with one matmul over the same fold: both must give the same bits, and match float64.
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, s_q, 8), torch.randn(2, h_kv, 6, 8), torch.randn(2, h_kv, 6, 3)
    mask = torch.rand(2, 1, s_q, 6) > 0.3
    eager = hwf.softmax_attention(q, k, v, mask, 8 ** -0.5)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = hwf.softmax_attention(q, k, v, mask, 8 ** -0.5)
    for got, want in zip(eager, traced):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    ref_z, ref_w = reference_heads(q.double(), k.double(), v.double(), mask=mask)
    torch.testing.assert_close(eager[0].double(), ref_z, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(eager[1].double(), ref_w, rtol=1e-5, atol=1e-6)


def test_per_row_sinks_are_accepted_under_compile_once_the_sequence_length_is_symbolic():
    # After two lengths dynamo traces s_q as a symbolic size: the sinks' shape check must still accept it.
    torch._dynamo.reset()
    compiled = torch.compile(hwf.attention, fullgraph=True, backend="eager")
    g = torch.Generator().manual_seed(0)
    for s in (5, 6):  # no sinks: they then come with concrete sizes, s_q already symbolic
        compiled(*(torch.randn(2, 4, s, 8, dtype=torch.float64, generator=g) for _ in range(3)), causal=True)
    for s in (7, 8):
        q, k, v = (torch.randn(2, 4, s, 8, dtype=torch.float64, generator=g) for _ in range(3))
        sinks = torch.randn(2, 4, s, 1, dtype=torch.float64, generator=g)
        z, _ = compiled(q, k, v, sinks=sinks, causal=True)
        torch.testing.assert_close(z, reference_heads(q, k, v, sinks=sinks, causal=True)[0])
