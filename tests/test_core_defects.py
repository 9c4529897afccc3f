"""Regression tests for the core defects of issue 14, one block per defect (each failed before its fix)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from headwise import AttentionConfig, AttentionHead, KVCache, MaterializationWarning, MultiHeadAttention
from headwise import RotaryEmbedding
from headwise import functional as hwf
from headwise import masks as hwm

PLAN = MultiHeadAttention.forward.__globals__["plan_attention"].__globals__


def _grads(attn: MultiHeadAttention, x: torch.Tensor, **kw) -> dict[str, torch.Tensor]:
    attn.zero_grad()
    x = x.detach().requires_grad_()
    out = attn(x, **kw)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    return {"x": x.grad, **{n: p.grad.clone() for n, p in attn.named_parameters()}}


# ---- a fully -inf additive row gave NaN gradients on the eager / weights / head paths -------------------------
def _blocked_row_masks():
    row = torch.zeros(3, 3, dtype=torch.float64)
    row[0] = float("-inf")
    keep = torch.tensor([[False, True, True], [False, False, False]])  # left padding; sequence 1 is all padding
    bias = torch.randn(3, 3, dtype=torch.float64)
    combined = hwm.combine_masks(hwm.padding_mask(keep=keep), bias, hwm.causal_mask(3))
    return {"row": row, "padding+bias+causal": combined}


@pytest.mark.parametrize("mask_name", ["row", "padding+bias+causal"])
@pytest.mark.parametrize("path", ["eager", "weights", "heads"])
def test_blocked_rows_give_finite_gradients_equal_to_the_fused_kernels(mask_name, path):
    mask = _blocked_row_masks()[mask_name]
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, backend="eager" if path == "eager" else "sdpa").double()
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    if path == "heads":
        def layer(inp, **kw):
            return sum(attn.head(i)(inp, **kw) @ attn.head(i).w_o for i in range(4)) + attn.out_proj.bias
        attn.zero_grad()
        xg = x.clone().requires_grad_()
        layer(xg, mask=mask).sum().backward()
        got = {"x": xg.grad, **{n: p.grad.clone() for n, p in attn.named_parameters()}}
    else:
        got = _grads(attn, x, mask=mask, return_weights=path == "weights")
    attn.backend = "sdpa"
    want = _grads(attn, x, mask=mask)  # PyTorch's fused kernel: the peer
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        torch.testing.assert_close(got[name], want[name])


# ---- a cached forward that raised after the write left the cache advanced ----------------------------------
def _cache_state(cache: KVCache):
    return cache.length, cache.keys.clone(), cache.values.clone()


def _assert_same_state(cache: KVCache, state, readable_only: bool = False) -> None:
    """Bitwise the same cache; ``readable_only``: the length and every position it reads (a write that was
    rolled back may leave its slots past the length, which no read ever reaches)."""
    length, keys, values = state
    assert cache.length == length
    n = length if readable_only else keys.shape[2]
    assert torch.equal(cache.keys[:, :, :n], keys[:, :, :n]) and torch.equal(cache.values[:, :, :n], values[:, :, :n])


def _filled(attn: MultiHeadAttention, n: int = 3) -> KVCache:
    cache = attn.new_cache(2, 8)
    attn(torch.randn(2, n, 16), cache=cache)
    return cache


def test_an_exception_in_the_attention_step_rolls_the_cache_back(monkeypatch):
    attn = MultiHeadAttention(16, 4, 2).eval()
    cache = _filled(attn)
    before = _cache_state(cache)

    def broken(*a, **k):
        raise RuntimeError("kernel failure")

    monkeypatch.setattr(F, "scaled_dot_product_attention", broken)
    with pytest.raises(RuntimeError, match="kernel failure"):
        attn(torch.randn(2, 1, 16), cache=cache)
    _assert_same_state(cache, before, readable_only=True)
    monkeypatch.undo()
    x = torch.randn(2, 1, 16)  # and decoding goes on as if the failed call never happened
    fresh = attn.new_cache(2, 8)
    fresh.update(before[1][:, :, :3], before[2][:, :, :3])
    torch.testing.assert_close(attn(x, cache=cache), attn(x, cache=fresh))


def test_a_warning_raised_as_an_error_leaves_the_cache_unchanged(monkeypatch):
    monkeypatch.setitem(PLAN, "FORWARD_WARN_BYTES", 0)
    attn = MultiHeadAttention(16, 4).eval()
    cache = _filled(attn)
    before = _cache_state(cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MaterializationWarning)
        with pytest.raises(MaterializationWarning):
            attn(torch.randn(2, 1, 16), cache=cache, return_weights=True)
    _assert_same_state(cache, before)


@pytest.mark.parametrize("shape", [(4,), (), (1, 4), (1, 1, 1, 4)])
@pytest.mark.parametrize("path", ["sdpa", "eager", "weights"])
def test_low_rank_masks_work_on_every_path_and_with_a_cache(shape, path):
    # A (s_kv,) or 0-D mask passed validation and then crashed SDPA with IndexError after the cache write.
    attn = MultiHeadAttention(16, 4, backend="eager" if path == "eager" else "sdpa").eval()
    keep = torch.tensor([True, False, True, True])
    mask = keep.reshape(shape) if shape else torch.tensor(True)
    full = keep.view(1, 1, 1, 4) if shape else torch.ones(1, 1, 1, 4, dtype=torch.bool)
    kw = {"return_weights": True} if path == "weights" else {}
    cache = _filled(attn)
    twin = KVCache(2, 8, 4, 4)
    twin.update(cache.keys[:, :, :3].clone(), cache.values[:, :, :3].clone())
    x = torch.randn(2, 1, 16)
    got = attn(x, cache=cache, mask=mask, **kw)
    want = attn(x, cache=twin, mask=full, **kw)
    torch.testing.assert_close(got, want)
    assert cache.length == twin.length == 4
    y = torch.randn(2, 4, 16)
    torch.testing.assert_close(attn(y, mask=mask, **kw), attn(y, mask=full, **kw))


# ---- the public functional API validates ---------------------------------------------------------------------
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
    with pytest.raises(ValueError, match="scale must be a positive finite float"):
        hwf.attention(q, k, v, scale=float("nan"))


def test_private_kernels_are_not_exported():
    assert not hasattr(hwf, "eager_attention") and not hasattr(hwf, "sdpa_attention")
    assert set(hwf.__all__) == {"split_heads", "split_qkv", "merge_heads", "attention", "attend", "available_backends"}


# ---- flags, configs and constructors refuse what they cannot mean -------------------------------------------
@pytest.mark.parametrize("name, call, exc, message", [
    ("return_weights string", lambda: MultiHeadAttention(16, 4)(torch.randn(1, 2, 16), return_weights="no"),
     TypeError, "return_weights must be a bool, got 'no'"),
    ("scale bool", lambda: AttentionConfig(16, 4, scale=True), TypeError, "scale"),
    ("scale nan", lambda: AttentionConfig(16, 4, scale=float("nan")), ValueError, "nan"),
    ("scale negative", lambda: MultiHeadAttention(16, 4, scale=-0.5), ValueError, "-0.5"),
    ("bias None", lambda: MultiHeadAttention(16, 4, bias=None), TypeError, "bias must be a bool"),
    ("positions without rotary", lambda: MultiHeadAttention(16, 4)(torch.randn(1, 2, 16), positions=torch.arange(2)),
     ValueError, "positions= is for rotary layers"),
    ("from_heads n_kv_heads 0", lambda: MultiHeadAttention.from_heads(
        MultiHeadAttention(16, 4).heads(), out_proj=MultiHeadAttention(16, 4).out_proj, n_kv_heads=0),
     ValueError, "n_kv_heads must be a positive int dividing the 4 heads given, got 0"),
    ("int dtype", lambda: MultiHeadAttention(16, 4, dtype=torch.int64), TypeError,
     "dtype must be a floating torch.dtype"),
    ("head of mixed dtypes", lambda: AttentionHead(torch.randn(8, 4), torch.randn(8, 4, dtype=torch.float64),
                                                   torch.randn(8, 4)), TypeError, "w_k is torch.float64"),
    ("config and fields", lambda: MultiHeadAttention(16, 4, config=AttentionConfig(16, 4)), ValueError,
     "either config= or the individual fields"),
    ("chunk_queries zero", lambda: setattr(MultiHeadAttention(16, 4), "chunk_queries", 0), TypeError,
     "chunk_queries must be True, False or a positive int"),
])
def test_bad_flags_and_types_are_refused(name, call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def _numpy_calls():
    attn = MultiHeadAttention(16, 4)
    rot = MultiHeadAttention(16, 4, rotary=RotaryEmbedding(4))
    x = torch.randn(1, 3, 16)
    a = np.zeros((1, 3, 16), dtype=np.float32)
    q = torch.randn(1, 4, 3, 4)
    return [
        ("x", lambda: attn(a)),
        ("context", lambda: attn(x, a)),
        ("mask", lambda: attn(x, mask=np.ones((3, 3), dtype=bool))),
        ("positions", lambda: rot(x, positions=np.arange(3))),
        ("head x", lambda: attn.head(0)(a)),
        ("split_heads", lambda: hwf.split_heads(a, 4)),
        ("merge_heads", lambda: hwf.merge_heads(np.zeros((1, 4, 3, 4)))),
        ("attention q", lambda: hwf.attention(np.zeros((1, 4, 3, 4)), q, q)),
        ("head weights", lambda: AttentionHead(np.zeros((8, 4)), torch.randn(8, 4), torch.randn(8, 4))),
    ]


@pytest.mark.parametrize("index", range(len(_numpy_calls())), ids=[n for n, _ in _numpy_calls()])
def test_numpy_arrays_where_tensors_belong_get_a_type_error(index):
    name, call = _numpy_calls()[index]
    with pytest.raises(TypeError, match="ndarray"):
        call()


# ---- one cache, one layer --------------------------------------------------------------------------------------
def test_a_cache_of_another_layer_is_refused_and_left_unchanged():
    a, b = MultiHeadAttention(16, 4).eval(), MultiHeadAttention(16, 4).eval()
    cache = _filled(a)
    before = _cache_state(cache)
    with pytest.raises(ValueError, match="one cache per layer"):
        b(torch.randn(2, 1, 16), cache=cache)
    with pytest.raises(ValueError, match="one cache per layer"):
        b.explain_dispatch(torch.randn(2, 1, 16), cache=cache)
    _assert_same_state(cache, before)
    a(torch.randn(2, 1, 16), cache=cache)  # its own layer still decodes into it
    assert cache.length == 4


def test_explaining_never_binds_a_cache():
    cache = KVCache(1, 4, 4, 4)
    a, b = MultiHeadAttention(16, 4), MultiHeadAttention(16, 4)
    a.explain_dispatch(torch.randn(1, 2, 16), cache=cache)
    assert cache.owner is None
    b(torch.randn(1, 2, 16), cache=cache)
    assert cache.owner is b


# ---- torch.export with dynamic shapes -------------------------------------------------------------------------
@pytest.mark.parametrize("n_kv_heads", [8, 2, 1])
def test_export_with_dynamic_batch_and_sequence(n_kv_heads):
    from torch.export import Dim, export

    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 8, n_kv_heads, rotary=RotaryEmbedding(4)).eval()

    class Causal(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = attn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, causal=True)

    program = export(Causal(), (torch.randn(2, 5, 32),), dynamic_shapes=({0: Dim("b"), 1: Dim("s")},))
    for shape in ((3, 9, 32), (1, 2, 32)):
        x = torch.randn(shape)
        torch.testing.assert_close(program.module()(x), attn(x, causal=True))
