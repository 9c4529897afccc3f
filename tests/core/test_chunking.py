"""Query-chunked long forwards (headwise.chunking): the same output as one pass, less memory, taken only when safe.

Chunking normally starts at hundreds of MiB of activations; these tests force small chunks on small shapes
(patching the layer's chunk rule) and compare against the unchunked layer and the float64 per-head reference.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise import MultiHeadAttention, RotaryEmbedding
from tests.reference import reference_mha
from tests.core.test_attention import build, cases

# The plan module as the layer sees it: collecting doctests with --import-mode=importlib can put a second copy
# of a headwise module in sys.modules, so module constants are patched through the function's own globals.
_PLAN_FORWARD = MultiHeadAttention.forward.__globals__["plan_forward"]
PLAN = _PLAN_FORWARD.__globals__["plan_attention"].__globals__


@contextmanager
def forced_chunks(attn: MultiHeadAttention, chunk: int):
    """``attn`` runs eligible forwards in chunks of ``chunk`` positions (its public ``chunk_queries`` setting);
    yields a list that receives, per forward, how many times W_O ran (one pass: 1; chunked: one per chunk)."""
    used: list[int] = []
    calls = [0]
    real = attn.out_proj.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    # Counted in the module's own forward, not by a hook: a layer with hooks on W_O is never chunked.
    attn.out_proj.forward = counted
    attn.chunk_queries = chunk
    try:
        yield used
    finally:
        del attn.out_proj.forward
        attn.chunk_queries = True
        used.append(calls[0])


@contextmanager
def without_cpu_flash_op(active: bool = True):
    """Pretend PyTorch has no CPU flash op with a log-sum-exp (as on other devices)."""
    if not active:
        yield
        return
    with mock.patch.dict(PLAN, {"lse_merge_available": lambda *a: False}):
        yield


def n_chunks(s: int, chunk: int) -> int:
    return -(-s // chunk) if chunk < s else 1


class FlashCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (key length, is_causal) of every call of PyTorch's CPU flash op."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            causal = args[4] if len(args) > 4 else (kwargs or {}).get("is_causal", False)
            self.calls.append((args[1].shape[2], bool(causal)))
        return func(*args, **(kwargs or {}))


def _inputs(case):
    attn, x, context, mask = build(case)
    if case["rotary"] and context is None and case["d_head"] % 2 == 0:
        attn.rotary = RotaryEmbedding(case["d_head"])
    positions = None
    if attn.rotary is not None and case["explicit_positions"]:
        g = torch.Generator().manual_seed(case["seed"] + 1)
        positions = torch.randint(0, 50, (case["b"], case["s_q"]), generator=g)
    return attn, x, context, mask, positions


@st.composite
def long_cases(draw):
    case = draw(cases())
    case["s_q"] = draw(st.integers(1, 13))  # several chunks, uneven last chunk
    case["s_kv"] = draw(st.integers(1, 13)) if case["cross"] else case["s_q"]
    case["rotary"] = draw(st.booleans())
    case["explicit_positions"] = draw(st.booleans())
    case["chunk"] = draw(st.integers(1, 5))
    case["cpu_flash_op"] = draw(st.booleans())  # False: causal chunks take the explicit-mask path
    return case


@settings(max_examples=80)
@given(long_cases())
def test_chunked_equals_one_pass_and_the_float64_reference(case):
    attn, x, context, mask, positions = _inputs(case)
    kw = dict(mask=mask, causal=case["causal"], positions=positions)
    with torch.no_grad():
        attn.chunk_queries = False
        whole = attn(x, context, **kw)
        attn.chunk_queries = True
        with forced_chunks(attn, case["chunk"]) as used, without_cpu_flash_op(not case["cpu_flash_op"]):
            chunked = attn(x, context, **kw)
    assert used == [n_chunks(case["s_q"], case["chunk"])]
    torch.testing.assert_close(chunked, whole)
    ref, _ = reference_mha(attn, x, context, mask=mask, causal=case["causal"], positions=positions)
    torch.testing.assert_close(chunked, ref)
    assert not chunked.isnan().any()


@pytest.mark.parametrize("chunk", [1, 2, 3, 4])
@pytest.mark.parametrize("n_kv_heads", [4, 1])
def test_causal_cross_attention_with_more_queries_than_keys(chunk, n_kv_heads):
    # The first four queries read no key: chunks of them alone have no key at all, and a square chunk
    # takes the kernel's is_causal, so neither has a mask whose dead rows could be opened.
    attn = MultiHeadAttention(16, 4, n_kv_heads, dtype=torch.float64)
    x, context = torch.randn(2, 7, 16, dtype=torch.float64), torch.randn(2, 3, 16, dtype=torch.float64)
    with torch.no_grad():
        whole = attn(x, context, causal=True)
        with forced_chunks(attn, chunk) as used:
            chunked = attn(x, context, causal=True)
    assert used == [n_chunks(7, chunk)]
    torch.testing.assert_close(chunked, whole)
    ref, _ = reference_mha(attn, x, context, causal=True)
    torch.testing.assert_close(chunked, ref)


def test_float32_chunked_matches_one_pass_with_padding_rows_and_gqa():
    attn = MultiHeadAttention(32, 8, 2, rotary=RotaryEmbedding(4)).eval()
    x = torch.randn(2, 11, 32)
    mask = torch.ones(2, 1, 1, 11, dtype=torch.bool)
    mask[1, ..., :] = False  # a sequence with nothing to read: zero context, never NaN
    with torch.no_grad():
        attn.chunk_queries = False
        whole = attn(x, mask=mask, causal=True)
        attn.chunk_queries = True
        with forced_chunks(attn, 4):
            chunked = attn(x, mask=mask, causal=True)
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(chunked[1], attn.out_proj.bias.expand(11, 32))


def test_unbatched_input_and_inputs_left_untouched():
    attn = MultiHeadAttention(16, 4, rotary=RotaryEmbedding(4)).eval()
    x = torch.randn(9, 16)
    before = x.clone()
    weights = {k: v.clone() for k, v in attn.state_dict().items()}
    with torch.no_grad():
        whole = attn(x, causal=True)
        with forced_chunks(attn, 2) as used:
            chunked = attn(x, causal=True)
    assert used == [5] and chunked.shape == (9, 16)
    torch.testing.assert_close(chunked, whole)
    assert torch.equal(x, before)
    assert all(torch.equal(v, weights[k]) for k, v in attn.state_dict().items())


@pytest.mark.parametrize("why", ["grad", "weights", "cache", "eager", "dropout", "opted_out"])
def test_not_chunked_where_it_would_change_more_than_memory(why):
    attn = MultiHeadAttention(16, 4, dropout=0.5 if why == "dropout" else 0.0,
                              backend="eager" if why == "eager" else "sdpa")
    attn.train(why == "dropout")
    x = torch.randn(1, 6, 16)
    kw = {"return_weights": True} if why == "weights" else {}
    if why == "cache":
        kw["cache"] = attn.new_cache(1, 6)
    with forced_chunks(attn, 2) as used, torch.set_grad_enabled(why == "grad"):
        if why == "opted_out":
            attn.chunk_queries = False
        attn(x, **kw)  # a fixed chunk length replaces the size rule only; the other conditions still apply
    assert used == [1]


def test_grad_enabled_but_nothing_tracked_still_chunks():
    attn = MultiHeadAttention(16, 4).requires_grad_(False)
    with forced_chunks(attn, 2) as used:
        attn(torch.randn(1, 6, 16))
    assert used == [3]


def test_a_frozen_layer_with_a_learned_mask_runs_in_one_pass_with_the_masks_gradient():
    # A floating mask that requires grad (a learned bias) is something in the call that takes a gradient.
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2).requires_grad_(False)
    x = torch.randn(1, 6, 16)
    bias = torch.randn(1, 2, 6, 6, dtype=torch.float64, requires_grad=True)
    with forced_chunks(attn, 2) as used:
        y = attn(x, mask=bias.float())
        assert attn.explain_dispatch(x, mask=bias.float()).query_chunk is None
        assert attn.explain_dispatch(x, mask=bias.detach().float()).query_chunk == 2  # nothing takes a gradient
    assert used == [1]
    (got,) = torch.autograd.grad(y.sum(), bias)
    (want,) = torch.autograd.grad(reference_mha(attn, x, mask=bias)[0].sum(), bias)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_frozen_layer_whose_values_take_a_gradient_runs_in_one_pass_with_their_gradient():
    # value= that requires grad (the values of another model's states) is something in the call that takes one.
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2).requires_grad_(False)
    x, key = torch.randn(1, 6, 16), torch.randn(1, 5, 16)
    value = torch.randn(1, 5, 16, dtype=torch.float64, requires_grad=True)
    with forced_chunks(attn, 2) as used:
        y = attn(x, key=key, value=value.float())
        assert attn.explain_dispatch(x, key=key, value=value.float()).query_chunk is None
        assert attn.explain_dispatch(x, key=key, value=value.detach().float()).query_chunk == 2
    assert used == [1]
    (got,) = torch.autograd.grad(y.sum(), value)
    (want,) = torch.autograd.grad(reference_mha(attn, x, key=key, value=value)[0].sum(), value)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("b", "s", "d", "h", "expected"),
    [
        (1, 8192, 4096, 32, None),      # Q, K, V, context = 512 MiB: at the threshold, one pass
        (1, 16384, 4096, 32, 1024),     # 1 GiB: 16 MiB of queries per chunk
        (2, 8192, 4096, 32, 512),       # 2 x 8192 x 4096 floats: 16 MiB holds 512 positions of 2 rows
        (16, 4096, 768, 12, 256),       # 768 MiB in all: 341 positions, rounded down to the 256 grid
        (64, 2048, 4096, 32, 256),      # huge batch: never below 256 positions
        (8, 512, 768, 12, None),        # a typical batch: far below the threshold
    ],
)
def test_chunk_length_rule(b, s, d, h, expected):
    attn = MultiHeadAttention(d, h, device="meta")
    assert PLAN["chunk_length"](attn.config.n_heads, attn.config.n_kv_heads, attn.config.d_head, b, s, s, torch.float32) == expected


def test_chunk_length_is_none_when_one_chunk_would_hold_every_query():
    attn = MultiHeadAttention(4096, 32, device="meta")
    # cross-attention to 100k keys: K/V are huge, but 256 queries fit in one chunk already
    assert PLAN["chunk_length"](attn.config.n_heads, attn.config.n_kv_heads, attn.config.d_head, 1, 256, 100_000, torch.float32) is None


def test_real_rule_chunks_a_long_forward_and_matches_one_pass(monkeypatch):
    # The size rule itself (not a forced chunk), scaled down: threshold 0 bytes, 300 positions' worth of
    # queries per chunk (8 floats each), rounded down to the 256-position grid.
    monkeypatch.setitem(PLAN, "CHUNK_ABOVE_BYTES", 0)
    monkeypatch.setitem(PLAN, "CHUNK_BYTES", 300 * 8 * 4)
    attn = MultiHeadAttention(8, 2).eval()
    x = torch.randn(1, 600, 8)
    assert PLAN["chunk_length"](attn.config.n_heads, attn.config.n_kv_heads, attn.config.d_head, 1, 600, 600, torch.float32) == 256
    with torch.no_grad():
        with forced_chunks(attn, True) as used:  # the size rule's own chunks (chunk_queries=True)
            chunked = attn(x, causal=True)
        assert used == [3]  # 256 + 256 + 88 positions
        attn.chunk_queries = False
        whole = attn(x, causal=True)
    torch.testing.assert_close(chunked, whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_causal_chunks_merge_two_kernel_calls_by_log_sum_exp(dtype, n_kv_heads):
    attn = MultiHeadAttention(32, 4, n_kv_heads, dtype=dtype).eval()
    x = torch.randn(2, 10, 32, dtype=dtype)
    with torch.no_grad():
        attn.chunk_queries = False
        whole = attn(x, causal=True)
        with forced_chunks(attn, 4), FlashCalls() as flash:
            merged = attn(x, causal=True)
        with forced_chunks(attn, 4), without_cpu_flash_op():
            masked = attn(x, causal=True)
    # chunks [0, 4), [4, 8), [8, 10): the square diagonal block causally, then the key prefix in full
    assert flash.calls == [(4, True), (4, True), (4, False), (2, True), (8, False)]
    torch.testing.assert_close(merged, whole)
    torch.testing.assert_close(masked, whole)


def test_explain_dispatch_reports_the_chunks(monkeypatch):
    monkeypatch.setitem(PLAN, "CHUNK_ABOVE_BYTES", 0)
    monkeypatch.setitem(PLAN, "CHUNK_BYTES", 256 * 8 * 4)
    attn = MultiHeadAttention(8, 2).eval()
    x = torch.randn(1, 600, 8)
    with torch.no_grad():
        info = attn.explain_dispatch(x, causal=True)
        assert info.query_chunk == 256 and info.causal_via == "kernel is_causal"
        assert any("256 positions at a time" in r for r in info.reasons)
        masked = attn.explain_dispatch(x, causal=True, mask=torch.ones(600, 600, dtype=torch.bool))
        assert masked.query_chunk == 256 and masked.causal_via == "explicit mask"
        assert attn.explain_dispatch(x, return_weights=True).query_chunk is None
    assert attn.explain_dispatch(x).query_chunk is None  # autograd on: one pass
