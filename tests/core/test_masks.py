"""Masks of every rank and kind reach every path; malformed masks are refused with a clear message."""

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

_PLAN_FORWARD = MultiHeadAttention.forward.__globals__["plan_forward"]
PLAN = _PLAN_FORWARD.__globals__["plan_attention"].__globals__


import math

import numpy as np
import pytest
import torch

from headwise import AttentionConfig, KVCache, MultiHeadAttention
from headwise import masks as hwm
from headwise.config import valid_head_counts


def brute_divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]



def _filled(attn: MultiHeadAttention, n: int = 3) -> KVCache:
    cache = attn.new_cache(2, 8)
    attn(torch.randn(2, n, 16), cache=cache)
    return cache


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







@pytest.mark.parametrize("shape", [(), (5,), (1, 5), (5, 5), (4, 5, 5)])
def test_validate_mask_returns_a_4d_view_without_copying(shape):
    m = torch.rand(shape) > 0.5
    out = hwm.validate_mask(m, (2, 4, 5, 5), torch.float32, torch.device("cpu"))
    assert out.shape == (1,) * (4 - len(shape)) + shape
    assert out.data_ptr() == m.data_ptr() and torch.equal(out.expand(2, 4, 5, 5), m.expand(2, 4, 5, 5))


def test_validation_reads_metadata_only():
    """Meta tensors have no data: any read of the values would raise."""
    meta = torch.device("meta")
    m = torch.empty(5, dtype=torch.bool, device=meta)
    assert hwm.validate_mask(m, (2, 4, 5, 5), torch.float32, meta).shape == (1, 1, 1, 5)
    f = torch.empty(5, 5, dtype=torch.float64, device=meta)
    assert hwm.validate_mask(f, (2, 4, 5, 5), torch.float16, meta).dtype == torch.float16
    with pytest.raises(TypeError, match="got torch.int64"):
        hwm.validate_mask(torch.empty(5, dtype=torch.int64, device=meta), (2, 4, 5, 5), torch.float32, meta)


@pytest.mark.parametrize("fn", [
    lambda m: hwm.validate_mask(m, (2, 4, 3, 3), torch.float32, torch.device("cpu")),
    lambda m: hwm.combine_masks(hwm.causal_mask(3), m),
    lambda m: MultiHeadAttention(16, 4)(torch.randn(2, 3, 16), mask=m),
])
def test_numpy_masks_are_a_type_error_naming_numpy(fn):
    with pytest.raises(TypeError, match=r"mask must be a torch.Tensor .*, got numpy.ndarray; "
                                        r"convert it with torch.from_numpy"):
        fn(np.ones((3, 3), dtype=bool))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int8])
def test_integer_masks_are_a_type_error_suggesting_bool(dtype):
    m = torch.ones(3, 3, dtype=dtype)
    for fn in (lambda: hwm.validate_mask(m, (2, 4, 3, 3), torch.float32, torch.device("cpu")),
               lambda: hwm.combine_masks(m), lambda: MultiHeadAttention(16, 4)(torch.randn(2, 3, 16), mask=m)):
        with pytest.raises(TypeError, match=rf"got {dtype}; a 0/1 integer mask is not added to the scores: "
                                            r"pass mask.bool\(\)"):
            fn()


@pytest.mark.parametrize("fn, exc, message", [
    (lambda: hwm.padding_mask(np.ones((2, 3), dtype=bool)), TypeError,
     r"keep must be a bool tensor of shape \(b, s_kv\), got numpy.ndarray"),
    (lambda: hwm.padding_mask(lengths="ab", s_kv=3), TypeError,
     r"lengths must be a 1-D integer sequence \(b,\), got 'ab' \(str\)"),
    (lambda: hwm.padding_mask(lengths=[1, None], s_kv=3), TypeError,
     r"lengths must be a 1-D integer sequence \(b,\), got \[1, None\] \(list\)"),
    (lambda: hwm.causal_mask(np.int64(3)), TypeError, r"s_q must be a non-negative int, got .*\(numpy.int64\)"),
    (lambda: hwm.causal_mask(3, 3.0), TypeError, r"s_kv must be a non-negative int, got 3.0 \(float\)"),
    (lambda: hwm.sliding_window_mask(3, window=np.int64(2)), TypeError,
     r"window must be a positive int, got .*\(numpy.int64\)"),
    (lambda: hwm.padding_mask(lengths=[1], s_kv=np.int64(3)), TypeError,
     r"s_kv must be a non-negative int, got .*\(numpy.int64\)"),
])
def test_mask_constructors_name_bad_types(fn, exc, message):
    with pytest.raises(exc, match=message):
        fn()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int64])
def test_left_padding_from_lengths_of_any_integer_dtype(dtype):
    # s_kv beyond the lengths' own dtype's range: the keys kept are still the last `length` ones
    s_kv = 300 if dtype != torch.int8 else 200
    lengths = torch.tensor([5, 0, 100], dtype=dtype)
    want = torch.stack([torch.arange(s_kv) >= s_kv - n for n in (5, 0, 100)])[:, None, None, :]  # (b, 1, 1, s_kv)
    assert torch.equal(hwm.padding_mask(lengths=lengths, s_kv=s_kv, left=True), want)
    assert torch.equal(hwm.padding_mask(lengths=lengths.numpy(), s_kv=s_kv, left=True), want)


def test_numpy_lengths_are_an_integer_sequence():
    out = hwm.padding_mask(lengths=np.array([2, 3]), s_kv=3)
    assert torch.equal(out, hwm.padding_mask(lengths=[2, 3], s_kv=3))




def test_masks_are_accepted_under_compile_once_the_sequence_length_is_symbolic():
    # After two lengths dynamo traces s_q as a symbolic size: the mask's shape check must still accept it.
    from tests.reference import reference_mha
    torch._dynamo.reset()
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, 2, dtype=torch.float64).eval()
    compiled = torch.compile(attn, fullgraph=True, backend="eager")
    with torch.no_grad():
        for s in (5, 6):  # unmasked: the mask then first comes with concrete sizes, s_q already symbolic
            compiled(torch.randn(2, s, 16, dtype=torch.float64), causal=True)
        for s in (7, 8):
            x = torch.randn(2, s, 16, dtype=torch.float64)
            for mask in ((torch.rand(s, s) > 0.3) | torch.eye(s, dtype=torch.bool),  # (s_q, s_kv)
                         hwm.padding_mask(lengths=[s, s - 2], s_kv=s)):  # (b, 1, 1, s_kv)
                torch.testing.assert_close(compiled(x, mask=mask), reference_mha(attn, x, mask=mask)[0])
