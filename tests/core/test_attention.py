"""MultiHeadAttention against the independent float64 per-head reference, and its head semantics."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise import AttentionConfig, MultiHeadAttention, RotaryEmbedding
from headwise.masks import padding_mask

from tests.reference import reference_mha


@st.composite
def cases(draw, *, allow_cross: bool = True):
    n_kv = draw(st.integers(1, 3))
    n_heads = n_kv * draw(st.integers(1, 3))
    d_head = draw(st.sampled_from([2, 4, 6]))
    d_model = n_heads * d_head if draw(st.booleans()) else draw(st.integers(1, 20))
    b = draw(st.integers(1, 3))
    s_q = draw(st.integers(1, 6))
    cross = allow_cross and draw(st.booleans())
    s_kv = draw(st.integers(1, 6)) if cross else s_q
    mask_kind = draw(st.sampled_from([None, "bool", "float", "padding", "per_head"]))
    causal = draw(st.booleans())
    bias = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return dict(n_kv=n_kv, n_heads=n_heads, d_head=d_head, d_model=d_model, b=b, s_q=s_q, s_kv=s_kv,
                cross=cross, mask_kind=mask_kind, causal=causal, bias=bias, seed=seed)


def build(case, dtype=torch.float64, backend="sdpa"):
    g = torch.Generator().manual_seed(case["seed"])
    attn = MultiHeadAttention(case["d_model"], case["n_heads"], case["n_kv"], d_head=case["d_head"],
                              bias=case["bias"], backend=backend, dtype=dtype)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.5)
    b, s_q, s_kv, h = case["b"], case["s_q"], case["s_kv"], case["n_heads"]
    x = torch.randn(b, s_q, case["d_model"], generator=g, dtype=dtype)
    context = torch.randn(b, s_kv, case["d_model"], generator=g, dtype=dtype) if case["cross"] else None
    kind = case["mask_kind"]
    mask = None
    if kind == "bool":
        mask = torch.rand(b, 1, s_q, s_kv, generator=g) > 0.3
    elif kind == "float":
        mask = torch.randn(s_q, s_kv, generator=g, dtype=dtype)
        mask = mask.masked_fill(torch.rand(s_q, s_kv, generator=g) > 0.7, float("-inf"))
    elif kind == "padding":
        lengths = torch.randint(0, s_kv + 1, (b,), generator=g)
        mask = padding_mask(lengths=lengths, s_kv=s_kv)
    elif kind == "per_head":
        mask = torch.rand(b, h, s_q, s_kv, generator=g) > 0.5
    return attn, x, context, mask


@settings(max_examples=80)
@given(cases())
def test_float64_matches_reference_on_both_backends(case):
    for backend in ("sdpa", "eager"):
        attn, x, context, mask = build(case, backend=backend)
        y_ref, w_ref = reference_mha(attn, x, context, mask=mask, causal=case["causal"])
        y = attn(x, context, mask=mask, causal=case["causal"])
        torch.testing.assert_close(y, y_ref)
        y2, w = attn(x, context, mask=mask, causal=case["causal"], return_weights=True)
        torch.testing.assert_close(y2, y_ref)
        torch.testing.assert_close(w, w_ref)


@settings(max_examples=40)
@given(cases())
def test_float32_matches_float64_reference(case):
    attn, x, context, mask = build(case, dtype=torch.float32)
    y_ref, _ = reference_mha(attn, x, context, mask=mask, causal=case["causal"])
    y = attn(x, context, mask=mask, causal=case["causal"])
    # float32 rounding through four matmuls and a softmax; see tests/TOLERANCES.md
    torch.testing.assert_close(y, y_ref.float(), rtol=1e-4, atol=1e-5)


@settings(max_examples=40)
@given(cases())
def test_fused_equals_eager_float32(case):
    attn, x, context, mask = build(case, dtype=torch.float32)
    fused = attn(x, context, mask=mask, causal=case["causal"])
    attn.backend = "eager"
    eager = attn(x, context, mask=mask, causal=case["causal"])
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-5)


@settings(max_examples=50)
@given(cases())
def test_head_by_head_equals_packed(case):
    attn, x, context, mask = build(case)
    y = attn(x, context, mask=mask, causal=case["causal"])
    heads = [attn.head(i)(x, context, mask=mask, causal=case["causal"]) for i in range(attn.n_heads)]
    torch.testing.assert_close(attn.out_proj(torch.cat(heads, dim=-1)), y)
    # The same through each head's own rows of W_O: the sum of what every head writes, plus the bias.
    written = sum(z @ attn.head(i).w_o for i, z in enumerate(heads))
    bias = 0 if attn.out_proj.bias is None else attn.out_proj.bias
    torch.testing.assert_close(written + bias, y)


@settings(max_examples=40)
@given(cases(allow_cross=False), st.integers(1, 5), st.booleans())
def test_cache_prefill_then_decode_equals_one_causal_pass(case, prefill, rotary):
    case = dict(case, d_model=case["n_heads"] * case["d_head"])
    attn, x, _, _ = build(case)
    if rotary:
        attn.rotary = RotaryEmbedding(case["d_head"], base=100.0)
    s = x.shape[1]
    prefill = min(prefill, s)
    full = attn(x, causal=True)
    cache = attn.new_cache(batch_size=x.shape[0], max_len=s + 2)
    steps = [attn(x[:, :prefill], cache=cache)]
    steps += [attn(x[:, t:t + 1], cache=cache) for t in range(prefill, s)]
    assert cache.length == s
    torch.testing.assert_close(torch.cat(steps, dim=1), full)
    y_ref, _ = reference_mha(attn, x, causal=True)
    torch.testing.assert_close(full, y_ref)


def test_gqa_query_head_reads_kv_head_h_over_group():
    # n_heads 6, n_kv_heads 2: heads 0-2 read K/V head 0, heads 3-5 read K/V head 1 (SDPA/HF convention).
    attn = MultiHeadAttention(24, 6, 2, dtype=torch.float64)
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    before = [attn.head(i)(x) for i in range(6)]
    with torch.no_grad():
        attn.v_proj.weight[4:8] += 1.0  # K/V head 1 (d_head 4)
    after = [attn.head(i)(x) for i in range(6)]
    changed = [not torch.allclose(a, b) for a, b in zip(before, after)]
    assert changed == [False, False, False, True, True, True]
    assert [attn.config.kv_head_of(i) for i in range(6)] == [0, 0, 0, 1, 1, 1]
    # The peer: SDPA's own enable_gqa on the layer's split heads.
    q, (k, v) = attn.project_q(x), attn.project_kv(x)
    peer = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(attn.project_out(peer), attn(x))


def test_unbatched_input_matches_batched():
    attn = MultiHeadAttention(16, 4, 2)
    x, c = torch.randn(5, 16), torch.randn(7, 16)
    torch.testing.assert_close(attn(x), attn(x[None])[0])
    y, w = attn(x, c, return_weights=True)
    y_b, w_b = attn(x[None], c[None], return_weights=True)
    torch.testing.assert_close(y, y_b[0])
    torch.testing.assert_close(w, w_b[0])
    assert w.shape == (4, 5, 7)


def test_weights_are_one_softmax_per_head():
    attn = MultiHeadAttention(32, 4)
    x = torch.randn(2, 6, 32)
    _, w = attn(x, return_weights=True, causal=True)
    assert w.shape == (2, 4, 6, 6)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6))
    assert torch.all(w.triu(1) == 0)
    assert not torch.allclose(w[:, 0], w[:, 1])  # heads differ: never averaged


def test_explicit_d_head_changes_w_o_shape():
    attn = MultiHeadAttention(d_model=20, n_heads=3, d_head=8, dtype=torch.float64)
    assert attn.out_proj.weight.shape == (20, 24)
    assert attn.head(2).w_q.shape == (20, 8)
    x = torch.randn(2, 4, 20, dtype=torch.float64)
    torch.testing.assert_close(attn(x), reference_mha(attn, x)[0])


@pytest.mark.parametrize("n_heads", [1, 4, 16, 64])
def test_parameters_are_4_d_model_squared_whatever_the_head_count(n_heads):
    attn = MultiHeadAttention(d_model=64, n_heads=n_heads, bias=False)
    assert sum(p.numel() for p in attn.parameters()) == 4 * 64 ** 2


def test_cross_attention_key_value_of_other_widths():
    cfg = AttentionConfig(d_model=12, n_heads=3, kdim=5, vdim=7)
    attn = MultiHeadAttention.from_config(cfg, dtype=torch.float64)
    x, k, v = (torch.randn(2, 4, 12, dtype=torch.float64), torch.randn(2, 6, 5, dtype=torch.float64),
               torch.randn(2, 6, 7, dtype=torch.float64))
    y_ref, w_ref = reference_mha(attn, x, key=k, value=v)
    y, w = attn(x, key=k, value=v, return_weights=True)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(w, w_ref)


def test_out_bias_and_scale_from_config():
    cfg = AttentionConfig(d_model=16, n_heads=4, out_bias=False, scale=0.3)
    attn = MultiHeadAttention.from_config(cfg, dtype=torch.float64)
    assert attn.out_proj.bias is None and attn.q_proj.bias is not None
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(attn(x), reference_mha(attn, x)[0])


def test_rotary_matches_reference_with_explicit_positions():
    attn = MultiHeadAttention(16, 4, 2, rotary=RotaryEmbedding(4, base=50.0), dtype=torch.float64)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]])
    y_ref, _ = reference_mha(attn, x, positions=pos, causal=True)
    torch.testing.assert_close(attn(x, positions=pos, causal=True), y_ref)
    # Shifting every position by the same amount leaves attention unchanged (relative positions only).
    torch.testing.assert_close(attn(x, positions=pos[0] + 11, causal=True)[0], attn(x, causal=True)[0])


def test_fully_masked_row_gives_zero_context_and_weights_on_both_paths():
    attn = MultiHeadAttention(16, 4, bias=False)
    x = torch.randn(2, 3, 16)
    mask = torch.ones(2, 1, 3, 3, dtype=torch.bool)
    mask[1, :, 2] = False
    for backend in ("sdpa", "eager"):
        attn.backend = backend
        y, w = attn(x, mask=mask, return_weights=True)
        assert torch.equal(y[1, 2], torch.zeros(16)) and not y.isnan().any()
        assert torch.equal(w[1, :, 2], torch.zeros(4, 3))
        assert torch.equal(attn(x, mask=mask)[1, 2], torch.zeros(16))


def test_dropout_only_in_training():
    attn = MultiHeadAttention(16, 4, dropout=0.5)
    x = torch.randn(2, 6, 16)
    attn.eval()
    y_eval = attn(x)
    torch.testing.assert_close(attn(x), y_eval)
    attn.backend = "eager"
    torch.testing.assert_close(attn(x), y_eval, rtol=1e-5, atol=1e-6)
    attn.train()
    for backend in ("sdpa", "eager"):
        attn.backend = backend
        torch.manual_seed(1)
        assert not torch.allclose(attn(x), y_eval)
    attn_no = MultiHeadAttention(16, 4, dropout=0.0).train()
    attn_no.load_state_dict(attn.state_dict())
    torch.testing.assert_close(attn_no(x), y_eval)


def test_weights_returned_in_training_are_those_after_dropout_the_output_is_made_of():
    attn = MultiHeadAttention(16, 4, 2, dropout=0.5).train()
    x = torch.randn(2, 6, 16)
    torch.manual_seed(3)
    y, w = attn(x, causal=True, return_weights=True)  # (b, s, d), (b, h, s, s)
    assert (w == 0).sum() > (~torch.ones(6, 6, dtype=torch.bool).tril()).sum() * 8  # more zeros than causality's
    p = {n: t.double() for n, t in attn.state_dict().items()}
    v = (x.double() @ p["v_proj.weight"].T + p["v_proj.bias"]).view(2, 6, 2, 4).transpose(1, 2)  # (b, h_kv, s, d_h)
    z = w.double() @ v.repeat_interleave(2, dim=1)  # (b, h, s, d_h): query head i reads K/V head i // 2
    want = z.transpose(1, 2).reshape(2, 6, 16) @ p["out_proj.weight"].T + p["out_proj.bias"]
    torch.testing.assert_close(y, want.float())


def test_works_under_no_grad_and_autograd_and_bfloat16():
    attn = MultiHeadAttention(16, 4, 2)
    x = torch.randn(2, 5, 16, requires_grad=True)
    with torch.no_grad():
        assert not attn(x).requires_grad
    attn(x, causal=True).sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in attn.parameters())
    ref = reference_mha(attn, x.detach(), causal=True)[0]
    bf = attn.to(torch.bfloat16)
    y = bf(x.detach().bfloat16(), causal=True)
    assert y.dtype == torch.bfloat16
    # bfloat16 keeps 8 bits of mantissa: ~3 significant digits; see tests/TOLERANCES.md
    torch.testing.assert_close(y.double(), ref, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_gradcheck_float64(backend):
    attn = MultiHeadAttention(8, 4, 2, backend=backend, dtype=torch.float64)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, False, True]]).expand(3, 4)
    assert torch.autograd.gradcheck(lambda a, b: attn(a, b, mask=mask), (x, c))
    assert torch.autograd.gradcheck(lambda a: attn(a, causal=True), (x,))
    params = list(attn.parameters())
    assert torch.autograd.gradcheck(
        lambda *ps: torch.func.functional_call(attn, dict(zip([n for n, _ in attn.named_parameters()], ps)),
                                               (x.detach(),), {"causal": True}),
        tuple(p.detach().requires_grad_() for p in params))


def test_softmax_scale_is_one_over_sqrt_d_head():
    attn = MultiHeadAttention(32, 4, bias=False, dtype=torch.float64)
    x = torch.randn(1, 3, 32, dtype=torch.float64)
    h0 = attn.head(0)
    q, k = x @ h0.w_q, x @ h0.w_k
    expected = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), -1)
    _, w = attn(x, return_weights=True)
    torch.testing.assert_close(w[:, 0], expected)


def test_a_copy_never_carries_a_tracer():
    import copy
    import pickle

    attn = MultiHeadAttention(16, 4)
    attn.tracer = object()  # what a trace puts on the layer while it is active
    for twin in (copy.deepcopy(attn), pickle.loads(pickle.dumps(MultiHeadAttention(16, 4)))):
        assert twin.tracer is None
    assert copy.deepcopy(attn).tracer is None and attn.tracer is not None


def test_weights_are_nn_linears_own_and_save_raw_with_safetensors(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    attn = MultiHeadAttention(16, 4, 2)
    x = torch.randn(2, 3, 16)
    safetensors.save_file(attn.state_dict(), str(tmp_path / "raw.safetensors"))  # contiguous tensors only
    loaded = MultiHeadAttention(16, 4, 2)
    loaded.load_state_dict(safetensors.load_file(str(tmp_path / "raw.safetensors")))
    torch.testing.assert_close(loaded(x), attn(x), rtol=0, atol=0)


def test_projections_are_plain_linears_with_standard_weights():
    attn = MultiHeadAttention(16, 4, 2)
    for name, shape in (("q_proj", (16, 16)), ("k_proj", (8, 16)), ("v_proj", (8, 16)), ("out_proj", (16, 16))):
        proj = getattr(attn, name)
        assert type(proj) is torch.nn.Linear and proj.weight.shape == shape
        assert proj.weight.is_contiguous()  # nn.Linear's own (out, in) layout
    assert list(attn.state_dict()) == ["q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
                                       "v_proj.weight", "v_proj.bias", "out_proj.weight", "out_proj.bias"]


def test_rotary_positions_are_accepted_under_compile_once_the_sequence_length_is_symbolic():
    # After two lengths dynamo traces s_q as a symbolic size: the positions' shape check must still accept it.
    torch._dynamo.reset()
    attn = MultiHeadAttention(16, 4, 2, rotary=RotaryEmbedding(4, base=50.0), dtype=torch.float64).eval()
    compiled = torch.compile(attn, fullgraph=True, backend="eager")
    with torch.no_grad():
        for s in (5, 6):  # default positions: given ones then come with concrete sizes, s_q already symbolic
            compiled(torch.randn(2, s, 16, dtype=torch.float64), causal=True)
        for s in (7, 8):
            x = torch.randn(2, s, 16, dtype=torch.float64)
            for pos in (torch.arange(s) + 3, torch.stack([torch.arange(s), torch.arange(s) + 4])):
                y_ref, _ = reference_mha(attn, x, positions=pos, causal=True)
                torch.testing.assert_close(compiled(x, positions=pos, causal=True), y_ref)
