"""KVCache: size, prefill + decode, overflow safety, reset, and torch.compile without recompiles."""

from __future__ import annotations

import pytest
import torch

from headwise import KVCache, MultiHeadAttention


@pytest.mark.parametrize("n_kv", [8, 2, 1])
def test_cache_stores_only_kv_heads(n_kv):
    attn = MultiHeadAttention(64, 8, n_kv)
    cache = attn.new_cache(batch_size=3, max_len=50)
    assert cache.keys.shape == (3, n_kv, 50, 8)
    assert cache.nbytes == 2 * 3 * 50 * n_kv * 8 * 4
    assert attn.to(torch.float64).new_cache(1, 10).nbytes == 2 * 1 * 10 * n_kv * 8 * 8


def test_overflow_raises_and_leaves_the_cache_unchanged():
    attn = MultiHeadAttention(16, 4, 2)
    cache = attn.new_cache(batch_size=2, max_len=5)
    x = torch.randn(2, 7, 16)
    attn(x[:, :4], cache=cache)
    keys, values, length = cache.keys.clone(), cache.values.clone(), cache.length
    with pytest.raises(ValueError, match=r"cache overflow: 4 cached \+ 2 new > max_len=5"):
        attn(x[:, 4:6], cache=cache)
    assert cache.length == length and torch.equal(cache.keys, keys) and torch.equal(cache.values, values)
    attn(x[:, 4:5], cache=cache)  # still usable
    assert cache.length == 5


def test_wrong_batch_or_dtype_is_refused_before_writing():
    attn = MultiHeadAttention(16, 4)
    cache = attn.new_cache(batch_size=2, max_len=5)
    with pytest.raises(ValueError, match=r"cache keys must have shape \(b=2, h_kv=4, s, d_h=4\), got \(3, 4, 1, 4\)"):
        attn(torch.randn(3, 1, 16), cache=cache)
    with pytest.raises(TypeError, match="cache holds torch.float64, got keys of dtype torch.float32"):
        attn(torch.randn(2, 1, 16), cache=KVCache(2, 5, 4, 4, dtype=torch.float64))
    assert cache.length == 0


def test_reset_then_decode_another_sequence_matches_a_fresh_cache():
    attn = MultiHeadAttention(16, 4, 2)
    a, b = torch.randn(1, 6, 16), torch.randn(1, 3, 16)
    cache = attn.new_cache(1, 8)
    attn(a, cache=cache)
    cache.reset()
    assert cache.length == 0
    used = torch.cat([attn(b[:, :1], cache=cache), attn(b[:, 1:], cache=cache)], 1)
    torch.testing.assert_close(used, attn(b, causal=True))


def test_compiled_decode_compiles_once_for_all_positions():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    attn = MultiHeadAttention(32, 4, 2).eval()
    x = torch.randn(2, 12, 32)
    counter = CompileCounter()
    step = torch.compile(attn, backend=counter, fullgraph=True)
    cache = attn.new_cache(2, 16)
    with torch.no_grad():
        outs = [step(x[:, :4], cache=cache), step(x[:, 4:5], cache=cache)]
        after_first_decode = counter.frame_count
        outs += [step(x[:, t:t + 1], cache=cache) for t in range(5, 12)]
    assert after_first_decode == 2  # the prefill graph and the decode graph
    assert counter.frame_count == 2  # ...and no recompilation at positions 5..11
    torch.testing.assert_close(torch.cat(outs, 1), attn(x, causal=True))


def test_default_path_compiles_without_graph_breaks():
    torch._dynamo.reset()
    attn = MultiHeadAttention(32, 8, 2)
    x = torch.randn(2, 6, 32)
    mask = torch.rand(2, 1, 6, 6) > 0.3
    compiled = torch.compile(attn, backend="aot_eager", fullgraph=True)  # fullgraph: a break would raise
    for kwargs in ({}, {"causal": True}, {"mask": mask}):
        torch.testing.assert_close(compiled(x, **kwargs), attn(x, **kwargs))
    compiled(x, causal=True).sum().backward()
    assert attn.q_proj.weight.grad is not None
