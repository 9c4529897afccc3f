"""KVCache safety: every refused write leaves the cache bitwise unchanged, and reset never exposes stale values."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from headwise import KVCache, MaterializationWarning, MultiHeadAttention
from headwise.decoding import DecodeStep
from headwise import masks as hwm

D, H, H_KV, D_H = 16, 4, 2, 4


def make(backend="sdpa"):
    torch.manual_seed(0)
    return MultiHeadAttention(D, H, H_KV, backend=backend).eval()


def snapshot(cache: KVCache):
    return cache.keys.clone(), cache.values.clone(), cache.length


def assert_unchanged(cache: KVCache, before) -> None:
    keys, values, length = before
    assert cache.length == length
    assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)


def kv(b=2, h=H_KV, s=1, d=D_H, **kw):
    return torch.randn(b, h, s, d, **kw), torch.randn(b, h, s, d, **kw)


BAD_WRITES = {
    "overflow": (lambda: kv(s=3), ValueError, r"cache overflow: 4 cached \+ 3 new > max_len=6"),
    "batch": (lambda: kv(b=3), ValueError, r"cache keys must have shape \(b=2, h_kv=2, s, d_h=4\), got \(3, 2, 1, 4\)"),
    "heads": (lambda: kv(h=4), ValueError, r"got \(2, 4, 1, 4\)"),
    "d_head": (lambda: kv(d=8), ValueError, r"got \(2, 2, 1, 8\)"),
    "dtype": (lambda: kv(dtype=torch.float64), TypeError, "cache holds torch.float32, got keys of dtype torch.float64"),
    "device": (lambda: kv(device="meta"), ValueError, "cache is on cpu, got keys on meta"),
    "lengths": (lambda: (torch.randn(2, 2, 1, 4), torch.randn(2, 2, 2, 4)), ValueError,
                "keys and values must have the same length, got 1 and 2"),
    "values only bad": (lambda: (torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4).half()), TypeError,
                        "got values of dtype torch.float16"),
    "not a tensor": (lambda: (torch.randn(2, 2, 1, 4), None), TypeError, "cache values must be a torch.Tensor, got NoneType"),
}


# write_static is what compiled steps call; it refuses an overflow on the device instead (tests/core).
@pytest.mark.parametrize("case, write", [(case, "update") for case in BAD_WRITES]
                         + [(case, "write_static") for case in BAD_WRITES if case != "overflow"])
def test_a_refused_write_leaves_the_cache_bitwise_unchanged(case, write):
    make_kv, exc, message = BAD_WRITES[case]
    cache = KVCache(2, 6, H_KV, D_H)
    cache.update(*kv(s=4))
    before = snapshot(cache)
    with pytest.raises(exc, match=message):
        getattr(cache, write)(*make_kv())
    assert_unchanged(cache, before)
    cache.update(*kv(s=2))  # and it still works afterwards
    assert cache.length == 6


FAILED_FORWARDS = {
    "overflow": (lambda a, c: a(torch.randn(2, 3, D), cache=c), ValueError, "cache overflow"),
    "batch": (lambda a, c: a(torch.randn(3, 1, D), cache=c), ValueError, r"it holds \(b, h_kv, d_h\) = \(2,"),
    "mask shape": (lambda a, c: a(torch.randn(2, 1, D), cache=c, mask=torch.ones(2, 1, 1, 3, dtype=torch.bool)),
                   ValueError, r"mask of shape \(2, 1, 1, 3\) does not broadcast to \(b, h, s_q, s_kv\) = \(2, 4, 1, 5\)"),
    "mask dtype": (lambda a, c: a(torch.randn(2, 1, D), cache=c, mask=torch.ones(5, dtype=torch.int64)),
                   TypeError, "mask must be bool"),
    "causal string": (lambda a, c: a(torch.randn(2, 1, D), cache=c, causal="top_left"), TypeError,
                      "causal must be a bool"),
    "x dtype": (lambda a, c: a(torch.randn(2, 1, D, dtype=torch.float64), cache=c), TypeError, "x has dtype"),
}


@pytest.mark.parametrize("case", list(FAILED_FORWARDS))
def test_a_failed_forward_leaves_the_cache_bitwise_unchanged(case):
    """Everything a call could refuse is checked before the cache is written (the mask check used to run
    after the write, advancing the cache on a call that then raised)."""
    call, exc, message = FAILED_FORWARDS[case]
    attn = make()
    cache = attn.new_cache(2, 6)
    attn(torch.randn(2, 4, D), cache=cache)
    before = snapshot(cache)
    with pytest.raises(exc, match=message):
        call(attn, cache)
    assert_unchanged(cache, before)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_reuse_after_reset_equals_a_fresh_cache(backend):
    """Decode sequence A, reset, decode a shorter sequence B: identical (bitwise) to B in a fresh cache.
    The stale positions of A are poisoned with NaN first, so reading any of them would show."""
    attn = make(backend)
    a, b = torch.randn(2, 6, D), torch.randn(2, 3, D)
    used = attn.new_cache(2, 6)
    attn(a[:, :4], cache=used)
    attn(a[:, 4:5], cache=used)
    attn(a[:, 5:6], cache=used)
    used.keys[:, :, 3:].fill_(float("nan"))
    used.values[:, :, 3:].fill_(float("nan"))
    used.reset()
    assert used.length == 0
    fresh = attn.new_cache(2, 6)

    def decode(cache):
        return torch.cat([attn(b[:, :2], cache=cache), attn(b[:, 2:3], cache=cache)], dim=1)

    y_used, y_fresh = decode(used), decode(fresh)
    assert torch.equal(y_used, y_fresh)
    assert torch.isfinite(y_used).all()
    torch.testing.assert_close(y_used, attn(b, causal=True))


def test_cache_decode_matches_a_full_causal_pass_with_padding():
    attn = make()
    x = torch.randn(2, 5, D)
    keep = hwm.padding_mask(lengths=[5, 3], s_kv=5, left=True)
    cache = attn.new_cache(2, 5)
    steps = [attn(x[:, :3], cache=cache, mask=keep[..., :3])]
    steps += [attn(x[:, t:t + 1], cache=cache, mask=keep[..., :t + 1]) for t in (3, 4)]
    torch.testing.assert_close(torch.cat(steps, 1), attn(x, mask=keep, causal=True))


def test_cache_of_batch_zero():
    attn = make()
    cache = attn.new_cache(0, 4)
    assert cache.nbytes == 0
    assert attn(torch.randn(0, 2, D), cache=cache).shape == (0, 2, D)
    assert cache.length == 2


def test_cache_bad_device_strings():
    with pytest.raises(ValueError, match="device must be a torch.device or a string such as 'cpu' or 'cuda:0', got 'gpu'"):
        KVCache(1, 4, 2, 4, device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda:0' was requested but CUDA is not available here"):
            KVCache(1, 4, 2, 4, device="cuda:0")


_PLAN_FORWARD = MultiHeadAttention.forward.__globals__["plan_forward"]
PLAN = _PLAN_FORWARD.__globals__["plan_attention"].__globals__


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


@pytest.mark.parametrize("route", ["forward", "decode step"])
@pytest.mark.parametrize("failure", ["W_O dtype", "a hook on W_O"])
def test_a_failure_after_attention_rolls_the_cache_back(route, failure):
    """W_O, or a forward hook on it, fails after the cache was written: the call leaves the
    cache's length and every position it reads as they were, on the forward and on the one-token route."""
    attn = MultiHeadAttention(16, 4, 2).eval()
    cache = _filled(attn)
    before = _cache_state(cache)
    call = (lambda x: attn(x, cache=cache)) if route == "forward" else DecodeStep(attn, cache)
    x = torch.randn(2, 1, 16)
    with torch.no_grad():
        if failure == "W_O dtype":
            attn.out_proj.double()
            with pytest.raises(RuntimeError, match="dtype"):
                call(x)
            attn.out_proj.float()
        else:
            def broken(module, args, output):
                raise RuntimeError("hook failure")

            handle = attn.out_proj.register_forward_hook(broken)
            with pytest.raises(RuntimeError, match="hook failure"):
                call(x)
            handle.remove()
        _assert_same_state(cache, before, readable_only=True)
        fresh = attn.new_cache(2, 8)  # and decoding goes on as if the failed call never happened
        fresh.update(before[1][:, :, :3], before[2][:, :, :3])
        torch.testing.assert_close(call(x), attn(x, cache=fresh))


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
