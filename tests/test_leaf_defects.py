"""Regression tests for defects in the leaf modules (config, masks, kv_cache), one block per defect."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from headwise import AttentionConfig, KVCache, MultiHeadAttention
from headwise import masks as hwm
from headwise.config import valid_head_counts
from tests.robustness.test_fuzz import reference


def brute_divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---- config: divisor enumeration must not be O(d_model) ----------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize("d_model", [10**12 + 1, 10**18 + 9, 2**61 - 1, (2**31 - 1) * (2**31 + 11)])
def test_huge_d_model_errors_without_enumerating_every_integer(d_model):
    # 2**61 - 1 is prime; (2**31 - 1) * (2**31 + 11) has two ~31-bit factors: the worst case for factoring.
    with pytest.raises(ValueError, match=rf"n_heads=7 does not divide d_model={d_model}; head counts that do near 7"):
        AttentionConfig(d_model=d_model, n_heads=7)
    counts = valid_head_counts(d_model)
    assert all(d_model % c == 0 for c in counts) and counts == sorted(set(counts))
    # every divisor pair (c, d_model // c) is listed
    assert [d_model // c for c in reversed(counts)] == counts


@pytest.mark.timeout(10)
def test_huge_n_heads_kv_message_is_fast():
    n_heads = 10**12 + 1  # = 73 * 137 * 99990001
    with pytest.raises(ValueError, match=r"valid n_kv_heads: \[1, 73, 137, 10001, 99990001, 7299270073, "
                                         r"13698630137, 1000000000001\]"):
        AttentionConfig(d_model=n_heads, n_heads=n_heads, n_kv_heads=2)


@pytest.mark.parametrize("n", [1, 2, 12, 36, 97, 360, 720, 1001, 4096, 5040, 65537, 99991 * 3])
def test_valid_head_counts_matches_brute_force(n):
    assert valid_head_counts(n) == brute_divisors(n)


def test_nearest_message_matches_brute_force_ratio_rule():
    for d_model, n_heads in [(4096, 30), (384, 10), (5040, 11), (1000, 3), (97, 5)]:
        divs = brute_divisors(d_model)
        near = sorted(sorted(divs, key=lambda v: (abs(math.log(v / n_heads)), v))[:4])
        with pytest.raises(ValueError, match=rf"near {n_heads}: \[{', '.join(map(str, near))}\]"):
            AttentionConfig(d_model=d_model, n_heads=n_heads)


def test_sizes_beyond_torch_sizes_are_refused():
    with pytest.raises(ValueError, match=r"d_model must be at most 2\*\*63 - 1"):
        AttentionConfig(d_model=2**63, n_heads=1)
    with pytest.raises(ValueError, match=r"valid_head_counts needs a positive int at most 2\*\*63 - 1, got 0"):
        valid_head_counts(0)
    with pytest.raises(TypeError, match=r"valid_head_counts needs a positive int at most 2\*\*63 - 1, got 12.0"):
        valid_head_counts(12.0)


# ---- config: scale / bias / dropout types ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (dict(scale=True), TypeError, r"scale must be a float or None, got True \(bool\)"),
        (dict(scale="0.5"), TypeError, r"scale must be a float or None, got '0.5' \(str\)"),
        (dict(scale=np.float32(0.5)), TypeError, r"scale must be a float or None, got .*\(numpy.float32\)"),
        (dict(scale=math.nan), ValueError, "scale must be a positive finite float or None, got nan"),
        (dict(scale=-0.5), ValueError, "scale must be a positive finite float or None, got -0.5"),
        (dict(scale=math.inf), ValueError, "scale must be a positive finite float or None, got inf"),
        (dict(scale=0), ValueError, "scale must be a positive finite float or None, got 0"),
        (dict(bias=None), TypeError, r"bias must be a bool, got None"),
        (dict(bias=1), TypeError, r"bias must be a bool, got 1 \(int\)"),
        (dict(out_bias=0), TypeError, r"out_bias must be a bool or None, got 0 \(int\)"),
        (dict(dropout=True), TypeError, r"dropout must be a float in \[0, 1\), got True \(bool\)"),
        (dict(dropout=np.float32(0.1)), TypeError, r"dropout must be a float in \[0, 1\), got .*\(numpy.float32\)"),
        (dict(dropout=math.nan), ValueError, r"dropout must be in \[0, 1\), got nan"),
    ],
)
def test_scale_bias_dropout_types(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        AttentionConfig(d_model=8, n_heads=2, **kwargs)


def test_out_bias_none_still_means_same_as_bias_and_numpy_float64_is_a_float():
    assert AttentionConfig(d_model=8, n_heads=2, bias=False, out_bias=None).out_bias is False
    assert AttentionConfig(d_model=8, n_heads=2, bias=True).out_bias is True
    assert AttentionConfig(d_model=8, n_heads=2, scale=np.float64(0.25)).scale == 0.25  # a float subclass
    assert AttentionConfig(d_model=8, n_heads=2, scale=2).scale == 2


@pytest.mark.parametrize("field", ["d_model", "n_heads", "n_kv_heads", "d_head", "kdim", "vdim"])
@pytest.mark.parametrize("np_int", [np.int64, np.int32])
def test_numpy_ints_are_a_type_error_naming_the_type(field, np_int):
    kwargs = dict(d_model=8, n_heads=2)
    kwargs[field] = np_int(2)
    with pytest.raises(TypeError, match=rf"{field} must be a positive int, got .*\(numpy.{np_int.__name__}\)"):
        AttentionConfig(**kwargs)


# ---- masks: 0-D / 1-D masks, numpy and integer masks -------------------------------------------------------


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_low_rank_masks_work_on_every_path(backend, kind):
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, 2, backend=backend).eval()
    x = torch.randn(2, 5, 16)
    keep = torch.tensor([True, False, True, True, False])
    one_d = keep if kind == "bool" else torch.zeros(5).masked_fill(~keep, -math.inf)
    full = one_d.expand(5, 5)
    ref = reference(attn, x, mask=full.expand(2, 4, 5, 5))[0]
    torch.testing.assert_close(attn(x, mask=one_d).double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(attn(x, mask=one_d), attn(x, mask=full))
    scalar = torch.tensor(True) if kind == "bool" else torch.tensor(0.0)
    torch.testing.assert_close(attn(x, mask=scalar), attn(x))
    torch.testing.assert_close(attn.head(1)(x, mask=one_d), attn.head(1)(x, mask=full))
    torch.testing.assert_close(attn(x[0], mask=one_d), attn(x[:1], mask=full)[0])  # unbatched input


def test_low_rank_mask_with_a_cache():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, 2).eval()
    x = torch.randn(1, 4, 16)
    keep = torch.tensor([True, False, True, True])
    cache = attn.new_cache(1, 8)
    attn(x[:, :3], cache=cache)
    step = attn(x[:, 3:], cache=cache, mask=keep)
    torch.testing.assert_close(step, attn(x, mask=hwm.combine_masks(hwm.causal_mask(4), keep))[:, 3:])


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


def test_numpy_lengths_are_an_integer_sequence():
    out = hwm.padding_mask(lengths=np.array([2, 3]), s_kv=3)
    assert torch.equal(out, hwm.padding_mask(lengths=[2, 3], s_kv=3))


# ---- kv_cache: owner, rollback, overflow under torch.compile -----------------------------------------------


def filled(cache: KVCache, n: int) -> KVCache:
    g = torch.Generator().manual_seed(n)
    shape = (cache.batch_size, cache.n_kv_heads, n, cache.d_head)
    cache.update(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    return cache


def snapshot(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor, int]:
    return cache.keys.clone(), cache.values.clone(), cache.length


def assert_same(cache: KVCache, snap: tuple[torch.Tensor, torch.Tensor, int]) -> None:
    assert cache.length == snap[2]
    assert torch.equal(cache.keys, snap[0]) and torch.equal(cache.values, snap[1])  # bitwise, every slot


def test_claim_binds_the_first_owner_and_refuses_others():
    a, b = MultiHeadAttention(16, 4, 2), MultiHeadAttention(16, 4, 2)
    cache = filled(KVCache(1, 8, 2, 4), 3)
    assert cache.owner is None
    cache.claim(a)
    cache.claim(a)  # the same owner: a no-op
    assert cache.owner is a
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=rf"belongs to <MultiHeadAttention at {id(a):#x}>, not "
                                         rf"<MultiHeadAttention at {id(b):#x}>: one cache per layer; "
                                         r"make another with layer.new_cache\(\.\.\.\)"):
        cache.claim(b)
    assert cache.owner is a
    assert_same(cache, snap)
    cache.reset()
    assert cache.owner is a
    with pytest.raises(AttributeError):
        cache.owner = b  # read-only


def test_claim_checkpoint_update_compile_into_one_graph_for_every_decode_position():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    owner = MultiHeadAttention(16, 4, 2)

    def step(cache, k, v):
        cache.claim(owner)
        saved = cache.checkpoint(k.shape[-2])
        keys, values = cache.update(k, v)
        return keys.sum(2) + values.sum(2), saved

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    cache, ref = KVCache(2, 12, 2, 4), KVCache(2, 12, 2, 4)
    cache.claim(owner)
    kv = torch.randn(2, 2, 10, 4)
    outs, expected = [], []
    for t0, t1 in [(0, 3)] + [(t, t + 1) for t in range(3, 10)]:
        out, saved = compiled(cache, kv[:, :, t0:t1], kv[:, :, t0:t1])
        outs.append(out)
        expected.append(ref.update(kv[:, :, t0:t1], kv[:, :, t0:t1])[0].sum(2) * 2)
    assert counter.frame_count == 2  # prefill, then one graph for decode positions 3..9
    torch.testing.assert_close(torch.stack(outs), torch.stack(expected))
    assert cache.length == 10 and torch.equal(cache.keys, ref.keys) and cache.owner is owner
    assert saved.length == 9 and torch.equal(saved.keys, torch.zeros(2, 2, 1, 4))  # slot 9 before its write
    torch.compile(lambda c, s: c.restore(s), backend="eager", fullgraph=True)(cache, saved)
    assert cache.length == 9 and torch.equal(cache.keys[:, :, :9], ref.keys[:, :, :9])
    assert torch.equal(cache.keys[:, :, 9], torch.zeros(2, 2, 4))


@pytest.mark.parametrize("n_written, n_saved", [(1, 1), (3, 3), (2, 3), (0, 2)])
def test_checkpoint_restore_is_bitwise_and_saves_only_the_new_slots(n_written, n_saved):
    cache = filled(KVCache(2, 10, 2, 4), 4)
    snap = snapshot(cache)
    cp = cache.checkpoint(n_saved)
    assert cp.keys.shape == cp.values.shape == (2, 2, n_saved, 4)  # the new slots only, not the context
    if n_written:
        filled(cache, n_written)
        assert not torch.equal(cache.keys, snap[0])
    cache.restore(cp)
    assert_same(cache, snap)
    filled(cache, 2)  # usable afterwards, as if nothing had happened
    assert cache.length == 6


def test_checkpoint_clamps_at_max_len_and_refuses_what_it_cannot_undo():
    cache = filled(KVCache(1, 5, 1, 2), 4)
    cp = cache.checkpoint(3)
    assert cp.keys.shape == (1, 1, 1, 2)  # only one slot is left before max_len
    snap = snapshot(cache)
    filled(cache, 1)
    cache.restore(cp)
    assert_same(cache, snap)

    cp = cache.checkpoint(1)
    filled(cache, 1)
    other = filled(KVCache(1, 5, 1, 2), 4)
    with pytest.raises(ValueError, match="this checkpoint was taken on another KVCache"):
        other.restore(cp)
    cache.reset()
    filled(cache, 2)
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"cannot restore: the checkpoint saved 1 positions after length 4, "
                                         r"but the cache now holds 2 and was reset since"):
        cache.restore(cp)
    assert_same(cache, snap)
    cp = cache.checkpoint(1)
    filled(cache, 2)
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"saved 1 positions after length 2, but the cache now holds 4"):
        cache.restore(cp)
    assert_same(cache, snap)
    with pytest.raises(TypeError, match="restore needs a KVCheckpoint"):
        cache.restore((2, None))
    with pytest.raises(ValueError, match="checkpoint needs a non-negative int"):
        cache.checkpoint(-1)


def test_checkpoint_restore_undoes_a_forward_that_fails_after_the_write():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, 2).eval()
    cache = attn.new_cache(1, 8)
    x = torch.randn(1, 6, 16)
    attn(x[:, :4], cache=cache)
    snap = snapshot(cache)
    cp = cache.checkpoint(2)
    attn(x[:, 4:6], cache=cache)  # pretend the forward failed after this write
    cache.restore(cp)
    assert_same(cache, snap)
    torch.testing.assert_close(attn(x[:, 4:6], cache=cache), attn(x, causal=True)[:, 4:6])


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_overflow_under_fullgraph_compile_raises_the_eager_value_error(backend):
    torch._dynamo.reset()
    cache = KVCache(1, 4, 2, 4)

    def step(k, v):
        keys, values = cache.update(k, v)
        return keys.sum() + values.sum()

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    kv = torch.randn(1, 2, 4, 4)
    compiled(kv[:, :, :2], kv[:, :, :2])
    for t in (2, 3):
        compiled(kv[:, :, t:t + 1], kv[:, :, t:t + 1])
    snap = snapshot(cache)
    for new in (1, 3):
        with pytest.raises(ValueError, match=rf"cache overflow: 4 cached \+ {new} new > max_len=4"):
            compiled(kv[:, :, :new], kv[:, :, :new])
        assert_same(cache, snap)
        with pytest.raises(ValueError, match=rf"cache overflow: 4 cached \+ {new} new > max_len=4"):
            step(kv[:, :, :new], kv[:, :, :new])  # eager: the same error
        assert_same(cache, snap)
    cache.reset()
    torch.testing.assert_close(compiled(kv[:, :, :1], kv[:, :, :1]), 2 * kv[:, :, :1].sum())  # still usable


def test_overflow_through_a_compiled_layer_raises_value_error():
    torch._dynamo.reset()
    attn = MultiHeadAttention(16, 4, 2).eval()
    step = torch.compile(attn, backend="eager", fullgraph=True)
    cache = attn.new_cache(1, 3)
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        step(x[:, :2], cache=cache)
        step(x[:, 2:3], cache=cache)
        snap = snapshot(cache)
        with pytest.raises(ValueError, match=r"cache overflow: 3 cached \+ 1 new > max_len=3"):
            step(x[:, 3:4], cache=cache)
    assert_same(cache, snap)
