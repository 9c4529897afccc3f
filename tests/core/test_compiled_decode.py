"""Decoding the way CUDA graphs want it: one compiled graph for every position, equal to the eager steps.

Under ``torch.compile`` a cached call writes at the cache's device position and reads the whole buffer under a
position mask, so no shape and no Python value changes between positions: ``CompileCounter`` sees one frame for
64+ positions with ``dynamic=False`` (a CUDA graph recorded once replays at each of them). CI has no GPU; the
CUDA-graph run itself is in tests/gpu.

Shapes:
    b: batch, s: sequence, d: model width, h: query heads, h_kv: key/value heads.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from headwise import DecodeStep, MultiHeadAttention, RotaryEmbedding


def _layer(h_kv: int, rotary: bool) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(32, 4, h_kv, rotary=RotaryEmbedding(8) if rotary else None).eval()


@pytest.mark.parametrize("h_kv, rotary", [(4, False), (2, True), (1, False)])
def test_a_compiled_step_compiles_once_for_every_position_and_equals_eager(h_kv, rotary):
    torch._dynamo.reset()
    attn = _layer(h_kv, rotary)
    x = torch.randn(2, 74, 32)
    cache = attn.new_cache(2, 80)
    counter = CompileCounter()
    step = torch.compile(DecodeStep(attn, cache), backend=counter, fullgraph=True, dynamic=False)
    with torch.no_grad():
        got = [attn(x[:, :8], cache=cache)] + [step(x[:, t:t + 1]) for t in range(8, 74)]  # 66 positions
        want = attn(x, causal=True)
    assert counter.frame_count == 1
    torch.testing.assert_close(torch.cat(got, 1), want)
    assert cache.length == 74  # the host reads the device's position back once


def test_eager_and_compiled_steps_interleave_on_one_cache():
    torch._dynamo.reset()
    attn = _layer(2, True)
    x = torch.randn(1, 20, 32)
    cache = attn.new_cache(1, 24)
    eager = DecodeStep(attn, cache)
    compiled = torch.compile(eager, backend="eager", fullgraph=True, dynamic=False)
    with torch.no_grad():
        got = [attn(x[:, :4], cache=cache)]
        for t in range(4, 20):
            got.append((compiled if t % 3 else eager)(x[:, t:t + 1]))
        want = attn(x, causal=True)
    torch.testing.assert_close(torch.cat(got, 1), want)


def test_a_compiled_step_past_max_len_is_refused_and_reported_at_the_next_host_use():
    torch._dynamo.reset()
    attn = _layer(2, False)
    cache = attn.new_cache(1, 5)
    step = torch.compile(DecodeStep(attn, cache), backend="eager", fullgraph=True, dynamic=False)
    x = torch.randn(1, 8, 32)
    with torch.no_grad():
        attn(x[:, :3], cache=cache)
        step(x[:, 3:4])
        step(x[:, 4:5])
        keys, values = cache.keys.clone(), cache.values.clone()
        refused = [step(x[:, t:t + 1]) for t in (5, 6)]
    assert all(torch.equal(r, attn.out_proj.bias.expand_as(r)) for r in refused)  # a zero context, then W_O
    assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)
    with pytest.raises(ValueError, match=r"2 compiled step\(s\) found all max_len=5 positions written"):
        cache.length
    assert cache.length == 5  # reported once, then the cache is usable again
    with pytest.raises(ValueError, match=r"cache overflow: 5 cached \+ 1 new > max_len=5"):
        attn(x[:, 5:6], cache=cache)  # eager code refuses at the call, as always


def test_the_layer_compiled_with_its_cache_takes_the_same_static_route():
    torch._dynamo.reset()
    attn = _layer(2, True)
    counter = CompileCounter()
    compiled = torch.compile(attn, backend=counter, fullgraph=True, dynamic=False)
    cache = attn.new_cache(2, 40)
    x = torch.randn(2, 36, 32)
    with torch.no_grad():
        got = [attn(x[:, :4], cache=cache)] + [compiled(x[:, t:t + 1], cache=cache) for t in range(4, 36)]
        want = attn(x, causal=True)
    assert counter.frame_count == 1
    torch.testing.assert_close(torch.cat(got, 1), want)
    info = attn.explain_dispatch(x[:, :1], cache=cache)
    assert info.plan.cache_read.name == "PREFIX"  # eager on CPU: the filled prefix, no mask


@pytest.mark.timeout(120)
def test_inductor_compiles_the_static_route_to_the_eager_answer():
    torch._dynamo.reset()
    attn = _layer(2, True)
    cache = attn.new_cache(1, 16)
    step = torch.compile(DecodeStep(attn, cache), fullgraph=True, dynamic=False)
    x = torch.randn(1, 12, 32)
    with torch.no_grad():
        got = [attn(x[:, :4], cache=cache)] + [step(x[:, t:t + 1]) for t in range(4, 12)]
        want = attn(x, causal=True)
    torch.testing.assert_close(torch.cat(got, 1), want)


def test_the_repr_of_a_cache_after_compiled_steps_shows_the_written_length():
    from headwise import DecodeStep, MultiHeadAttention

    attn = MultiHeadAttention(32, 4, 2).eval()
    cache = attn.new_cache(1, 16)
    step = torch.compile(DecodeStep(attn, cache), backend="eager", fullgraph=True, dynamic=False)
    x = torch.randn(1, 12, 32)
    with torch.no_grad():
        attn(x[:, :4], cache=cache)
        for t in range(4, 12):
            step(x[:, t:t + 1])
    assert "length=12," in repr(cache)
    assert cache.length == 12
