"""Decoding the way CUDA graphs want it: one compiled graph for every position, equal to the eager steps.

Under ``torch.compile`` a cached call writes at the cache's device position and reads the whole buffer under a
position mask, so no shape and no Python value changes between positions: ``CompileCounter`` sees one frame for
64+ positions with ``dynamic=False`` (a CUDA graph recorded once replays at each of them). CI has no GPU; the
CUDA-graph run itself is in tests/gpu.

Shapes:
    b: batch, s: sequence, d: model width, h: query heads, h_kv: key/value heads.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import headwise
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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rotary", [False, True])
def test_a_compiled_step_recorded_by_autograd_compiles_once_and_has_the_eager_gradients(rotary):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    attn = _layer(2, rotary)  # parameters require grad: autograd records every step
    twin = copy.deepcopy(attn)
    x = torch.randn(2, 16, 32)
    cache, twin_cache = attn.new_cache(2, 20), twin.new_cache(2, 20)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(DecodeStep(attn, cache), backend=counter, fullgraph=True, dynamic=False)
    eager = DecodeStep(twin, twin_cache)
    with torch.no_grad():
        attn(x[:, :4], cache=cache)
        twin(x[:, :4], cache=twin_cache)
    tokens = [x[:, t:t + 1].clone().requires_grad_() for t in range(4, 16)]  # 12 positions
    twin_tokens = [t.detach().clone().requires_grad_() for t in tokens]
    got = [step(t) for t in tokens]
    want = [eager(t) for t in twin_tokens]
    assert counter.frame_count == 1
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1))
    with torch.no_grad():  # the eager steps themselves: one causal pass over the whole sequence
        torch.testing.assert_close(torch.cat(want, 1), twin(x, causal=True)[:, 4:])
    weights = torch.randn(2, 12, 32)
    (torch.cat(got, 1) * weights).sum().backward()
    (torch.cat(want, 1) * weights).sum().backward()
    for a, b in zip(tokens, twin_tokens):
        torch.testing.assert_close(a.grad, b.grad)
    for (name, p), q in zip(attn.named_parameters(), twin.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert not cache.keys.requires_grad and cache.length == 16


def test_compiled_cached_calls_returning_weights_get_them_over_the_whole_buffer():
    torch._dynamo.reset()
    attn = _layer(2, False)
    cache = attn.new_cache(2, 16)
    counter = CompileCounter()
    compiled = torch.compile(lambda t: attn(t, cache=cache, return_weights=True), backend=counter, fullgraph=True,
                             dynamic=False)
    x = torch.randn(2, 14, 32)
    with torch.no_grad():
        attn(x[:, :4], cache=cache)
        got = [compiled(x[:, t:t + 1]) for t in range(4, 14)]
        y, weights = attn(x, causal=True, return_weights=True)  # (b, h, s, s)
    assert counter.frame_count == 1
    for t, (y_t, w_t) in zip(range(4, 14), got):
        torch.testing.assert_close(y_t, y[:, t:t + 1])
        assert w_t.shape == (2, 4, 1, 16)
        torch.testing.assert_close(w_t[..., :14], weights[:, :, t:t + 1])  # zero past the written positions
        assert not w_t[..., 14:].any()


def test_a_compiled_step_recorded_by_autograd_past_max_len_is_refused_and_reported():
    torch._dynamo.reset()
    attn = _layer(2, False)  # parameters require grad
    cache = attn.new_cache(1, 5)
    step = torch.compile(DecodeStep(attn, cache), backend="aot_eager", fullgraph=True, dynamic=False)
    x = torch.randn(1, 7, 32)
    attn(x[:, :4], cache=cache)
    step(x[:, 4:5]).sum().backward()
    keys = cache.keys.clone()
    refused = step(x[:, 5:6])
    refused.sum().backward()  # the refused step's graph has a backward too
    torch.testing.assert_close(refused, attn.out_proj.bias.detach().expand_as(refused), rtol=0, atol=0)
    assert torch.equal(cache.keys, keys)
    with pytest.raises(ValueError, match=r"1 compiled step\(s\) found all max_len=5 positions written"):
        cache.length
    assert cache.length == 5


@pytest.mark.parametrize("drop", ["reset", "crop"])
def test_compiled_steps_after_dropping_nan_poisoned_slots_equal_a_fresh_cache_bitwise(drop):
    # The position route reads the whole buffer under a mask: a NaN left in a dropped slot would poison every
    # output (0 * NaN), so reset and crop zero what they drop.
    torch._dynamo.reset()
    attn = _layer(2, False)
    x_old, x_new = torch.randn(1, 6, 32), torch.randn(1, 4, 32)
    x_old[0, 5] = float("nan")  # an earlier sequence with a bad last token
    cache, fresh = attn.new_cache(1, 8), attn.new_cache(1, 8)
    step = torch.compile(DecodeStep(attn, cache), backend="eager", fullgraph=True, dynamic=False)
    with torch.no_grad():
        for t in range(6):
            step(x_old[:, t:t + 1])
        assert cache.keys.isnan().any()
        cache.reset() if drop == "reset" else cache.crop(1)
        start = 0 if drop == "reset" else 1
        if start:
            attn(x_old[:, :1], cache=fresh)
        got = torch.cat([step(x_new[:, t:t + 1]) for t in range(4)], 1)
        fresh_step = torch.compile(DecodeStep(attn, fresh), backend="eager", fullgraph=True, dynamic=False)
        want = torch.cat([fresh_step(x_new[:, t:t + 1]) for t in range(4)], 1)
    assert not got.isnan().any()
    assert torch.equal(got, want)
    assert torch.equal(cache.keys, fresh.keys) and torch.equal(cache.values, fresh.values)


def test_a_compiled_step_with_frozen_keys_and_values_has_the_gradients_of_one_causal_pass():
    # Only the queries carry a gradient: autograd saves the buffers the step reads, so the step hands it a copy
    # (the next write would change the buffers under it).
    torch._dynamo.reset()
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2, dtype=torch.float64)
    for p in (*attn.k_proj.parameters(), *attn.v_proj.parameters()):
        p.requires_grad_(False)
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    want = torch.autograd.grad(attn(x, causal=True)[:, 2:].pow(2).sum(), attn.q_proj.weight)[0]
    cache = attn.new_cache(1, 8)
    step = torch.compile(DecodeStep(attn, cache), backend="eager", fullgraph=True)
    ys = [step(x[:, :2])] + [step(x[:, t:t + 1]) for t in range(2, 5)]
    got = torch.autograd.grad(torch.cat(ys, 1)[:, 2:].pow(2).sum(), attn.q_proj.weight)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not cache.keys.requires_grad and cache.length == 5


def test_a_compiled_call_with_more_new_tokens_than_max_len_raises_the_eager_overflow_and_writes_nothing():
    torch._dynamo.reset()
    attn = _layer(2, False)
    x = torch.randn(2, 10, 32)
    eager_cache, cache = attn.new_cache(2, 8), attn.new_cache(2, 8)
    with pytest.raises(ValueError) as eager:
        attn(x, cache=eager_cache)
    keys, values = cache.keys.clone(), cache.values.clone()
    call = torch.compile(lambda t, c: attn(t, cache=c), backend="eager", fullgraph=True)
    with torch.no_grad(), pytest.raises(ValueError) as compiled:
        call(x, cache)
    assert str(compiled.value) == str(eager.value) == "cache overflow: 0 cached + 10 new > max_len=8; " \
        "allocate a larger cache or reset() it"
    torch.testing.assert_close(cache.keys, keys, rtol=0, atol=0)
    torch.testing.assert_close(cache.values, values, rtol=0, atol=0)
    assert cache.length == 0
    with torch.no_grad():  # the cache still works: a call that fits equals the uncached layer
        torch.testing.assert_close(attn(x[:, :8], cache=cache), attn(x[:, :8], causal=True))
    # After compiled writes (which advance the device's position, not the host's length) the message counts them.
    cache.reset()
    with torch.no_grad():
        call(x[:, :3], cache)
        with pytest.raises(ValueError, match=r"^cache overflow: 3 cached \+ 10 new > max_len=8;"):
            call(x, cache)
    assert cache.length == 3


@pytest.mark.parametrize("failure", ["a hook on W_O", "a refused pattern edit"])
def test_a_compiled_step_that_fails_after_its_write_rolls_back_and_its_retry_equals_a_first_try_bitwise(failure):
    # Plain torch.compile runs the failure's handler in compiled code: the write at the device position must be
    # undone there (the position put back, the slot zeroed), or a retry stores the token twice.
    torch._dynamo.reset()
    attn = _layer(2, False)
    x = torch.randn(1, 7, 32)
    fail = [False]

    def hook(module, args, output):
        if fail[0]:
            raise RuntimeError("hook failure")

    attn.out_proj.register_forward_hook(hook)

    def fail_at(step, token):  # the step fails after its write: the hook raises, or a trace refuses the edit
        if failure == "a hook on W_O":
            fail[0] = True
            with pytest.raises(RuntimeError, match="hook failure"):
                step(token)
            fail[0] = False
        else:
            with pytest.raises(ValueError, match="a pattern edit needs every value"), \
                    headwise.trace(attn, edit={(0, 1, "pattern"): "zero"}):
                step(token)

    cache, clean = attn.new_cache(1, 8), attn.new_cache(1, 8)
    step = torch.compile(DecodeStep(attn, cache), backend="eager", dynamic=False)
    clean_step = torch.compile(DecodeStep(attn, clean), backend="eager", dynamic=False)
    with torch.no_grad():
        got = [attn(x[:, :4], cache=cache), step(x[:, 4:5])]
        want = [attn(x[:, :4], cache=clean), clean_step(x[:, 4:5])]
        fail_at(step, x[:, 5:6])
        assert cache.length == 5
        assert torch.equal(cache.keys, clean.keys) and torch.equal(cache.values, clean.values)
        got += [step(x[:, t:t + 1]) for t in (5, 6)]  # the failed token again, then the next
        want += [clean_step(x[:, t:t + 1]) for t in (5, 6)]
        one_pass = attn(x, causal=True)
    assert torch.equal(torch.cat(got, 1), torch.cat(want, 1))
    assert torch.equal(cache.keys, clean.keys) and torch.equal(cache.values, clean.values)
    torch.testing.assert_close(torch.cat(got, 1), one_pass)
    # A failed step on a full cache (its write refused for lack of room) leaves no refusal behind either: the
    # next host use finds the cache as it was, not an overflow of a step that never completed.
    full = attn.new_cache(1, 4)
    full_step = torch.compile(DecodeStep(attn, full), backend="eager", dynamic=False)
    with torch.no_grad():
        attn(x[:, :4], cache=full)
        fail_at(full_step, x[:, 4:5])
    assert full.length == 4


def test_a_compiled_step_refuses_a_key_edit_of_one_query_head_of_a_gqa_cache_as_eager_does():
    # The edit reshapes k to the query heads after the layer's checks: the cache's write checks it again.
    # (Under fullgraph=True dynamo refuses to compile any Python raise, so there it cannot be the ValueError.)
    attn = _layer(2, False)
    x = torch.randn(1, 5, 32)
    errors = []
    for compiled in (False, True):
        torch._dynamo.reset()
        cache = attn.new_cache(1, 8)
        with torch.no_grad():
            attn(x[:, :4], cache=cache)
        keys, values = cache.keys.clone(), cache.values.clone()
        step = DecodeStep(attn, cache)
        if compiled:
            step = torch.compile(step, backend="eager", dynamic=False)
        with pytest.raises(ValueError) as error, torch.no_grad(), headwise.trace(attn, edit={(0, 1, "k"): 0.5}):
            step(x[:, 4:5])
        errors.append(str(error.value))
        assert cache.length == 4
        assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)
    assert errors[1] == errors[0] == "cache keys must have shape (b=1, h_kv=2, s, d_h=8), got (1, 4, 1, 8)"
