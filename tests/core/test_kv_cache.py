"""KVCache: size, prefill + decode, overflow safety, reset, and torch.compile without recompiles."""

from __future__ import annotations

import copy
import math
import pickle
import subprocess
import warnings
import sys

import pytest
import torch
import numpy as np
import torch.nn.functional as F

from headwise import AttentionConfig, AttentionHead, KVCache, MaterializationWarning, MultiHeadAttention
from headwise import RotaryEmbedding
from headwise import functional as hwf
from headwise import masks as hwm
from headwise.config import valid_head_counts


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
    with pytest.raises(ValueError, match=r"it holds \(b, h_kv, d_h\) = \(2, 4, 4\), this layer writes \(3, 4, 4\)"):
        attn(torch.randn(3, 1, 16), cache=cache)
    with pytest.raises(TypeError, match="the cache holds torch.float64, this layer writes torch.float32 keys"):
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


def _filled(attn: MultiHeadAttention, n: int = 3) -> KVCache:
    cache = attn.new_cache(2, 8)
    attn(torch.randn(2, n, 16), cache=cache)
    return cache


_PLAN_FORWARD = MultiHeadAttention.forward.__globals__["plan_forward"]
PLAN = _PLAN_FORWARD.__globals__["plan_attention"].__globals__






def brute_divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]



def test_explaining_never_binds_a_cache():
    cache = KVCache(1, 4, 4, 4)
    a, b = MultiHeadAttention(16, 4), MultiHeadAttention(16, 4)
    a.explain_dispatch(torch.randn(1, 2, 16), cache=cache)
    assert cache.owner is None
    b(torch.randn(1, 2, 16), cache=cache)
    assert cache.owner is b






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


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("n_kv", [4, 2])
def test_gradients_of_a_cached_call_reach_its_own_keys_as_in_one_pass(backend, n_kv):
    # The cache's buffers hold no history; the keys and values a call writes keep theirs in what it attends to.
    attn = MultiHeadAttention(16, 4, n_kv, backend=backend, dtype=torch.float64)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    cached_x, whole_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    cached = attn(cached_x[:, :3], cache=attn.new_cache(2, 8))
    cached_grads = torch.autograd.grad(cached.square().sum(), [cached_x, *attn.parameters()])
    whole = attn(whole_x[:, :3], causal=True)
    whole_grads = torch.autograd.grad(whole.square().sum(), [whole_x, *attn.parameters()])
    for got, want in zip(cached_grads, whole_grads):
        torch.testing.assert_close(got, want)
    # A step after a prefill: its token's gradient is the last row's of one causal pass (earlier rows never
    # read the last token).
    cache = attn.new_cache(2, 8)
    with torch.no_grad():
        attn(x[:, :4], cache=cache)
    step_x, whole_x = x[:, 4:].clone().requires_grad_(), x.clone().requires_grad_()
    step = attn(step_x, cache=cache)
    whole = attn(torch.cat([x[:, :4], whole_x[:, 4:]], 1), causal=True)[:, 4:]
    torch.testing.assert_close(step, whole)
    got, = torch.autograd.grad(step.square().sum(), step_x)
    want, = torch.autograd.grad(whole.square().sum(), whole_x)
    torch.testing.assert_close(got, want[:, 4:])
    assert not cache.keys.requires_grad and not cache.values.requires_grad


def test_a_compiled_write_keeps_the_new_keys_history_and_the_buffers_none():
    cache = KVCache(1, 6, 2, 4, dtype=torch.float64)
    k = torch.randn(1, 2, 2, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 2, 4, dtype=torch.float64, requires_grad=True)
    keys, values, mask, room = cache.write_static(k, v)
    assert bool(room) and not cache.keys.requires_grad
    gk, gv = torch.autograd.grad((keys * 2).sum() + (values * 3).sum(), [k, v])
    torch.testing.assert_close(gk, torch.full_like(k, 2.0))
    torch.testing.assert_close(gv, torch.full_like(v, 3.0))
    torch.testing.assert_close(cache.keys[:, :, :2], k.detach())


def test_attend_refuses_a_cache_without_forwards_plan():
    attn = MultiHeadAttention(16, 4, 2)
    cache = attn.new_cache(1, 8)
    q, k, v = torch.randn(1, 4, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"attend: cache is forward's own argument.*attn\(x, cache=cache\)"):
        attn.attend(q, k, v, causal=True, cache=cache)
    assert_same(cache, snap)


@pytest.mark.parametrize("copier", [copy.deepcopy, copy.copy], ids=["deepcopy", "copy"])
def test_a_copied_cache_is_a_branch_for_the_same_layer(copier):
    # Beam search and speculative decoding branch a decoding state by copying it; a shallow copy too, since
    # sharing the buffers or the position would let two branches overwrite each other's slots.
    attn = MultiHeadAttention(16, 4, 2).eval()
    x = torch.randn(1, 6, 16)
    cache = attn.new_cache(1, 8)
    with torch.no_grad():
        attn(x[:, :3], cache=cache)
        snap = snapshot(cache)
        branch = copier(cache)
        assert branch.owner is attn and branch.keys.data_ptr() != cache.keys.data_ptr()
        for name in ("keys", "values", "position"):
            assert getattr(branch, name).data_ptr() != getattr(cache, name).data_ptr(), name
        torch.testing.assert_close(attn(x[:, 3:], cache=branch), attn(x, causal=True)[:, 3:])
        assert_same(cache, snap)  # the original is untouched by the branch
        assert branch.length == 6
        torch.testing.assert_close(attn(x[:, 3:4], cache=cache), attn(x[:, :4], causal=True)[:, 3:])
        # Copied with its layer, the cache belongs to the layer's copy.
        pair = copy.deepcopy({"layer": attn, "cache": branch})
        assert pair["cache"].owner is pair["layer"]
        # A pickle carries the positions, not the layer: the first layer to use it claims it.
        loaded = pickle.loads(pickle.dumps(branch))
        assert loaded.owner is None and loaded.length == 6
        assert torch.equal(loaded.keys, branch.keys) and torch.equal(loaded.values, branch.values)
        loaded.reset()
        attn(x[:, :2], cache=loaded)
        assert loaded.owner is attn and loaded.length == 2
        with pytest.raises(ValueError, match="one cache per layer"):  # a copy is still the first layer's
            MultiHeadAttention(16, 4, 2)(x[:, 3:4], cache=copier(cache))


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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_overflow_of_a_compiled_call_recorded_by_autograd_raises_the_eager_value_error_at_run_time(backend):
    # A user mask keeps the prefix read (KVCache.update) in compiled code; the parameters require grad, so the
    # compiler traces the backward of the overflow branch too.
    torch._dynamo.reset()
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, 2).eval()
    twin = copy.deepcopy(attn)
    cache, twin_cache = attn.new_cache(1, 5), twin.new_cache(1, 5)
    x = torch.randn(1, 7, 16)
    compiled = torch.compile(lambda t, m: attn(t, cache=cache, mask=m), backend=backend, fullgraph=True,
                             dynamic=False)
    with torch.no_grad():
        attn(x[:, :3], cache=cache)
        twin(x[:, :3], cache=twin_cache)
    for t in (3, 4):  # compiled decoding with autograd: the eager outputs and gradients
        mask = torch.rand(1, 1, 1, t + 1) > 0.3
        mask[..., -1] = True
        got, want = compiled(x[:, t:t + 1], mask), twin(x[:, t:t + 1], cache=twin_cache, mask=mask)
        torch.testing.assert_close(got, want)
        got.square().sum().backward()
        want.square().sum().backward()
    for p, q in zip(attn.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    snap = snapshot(cache)
    mask = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"cache overflow: 5 cached \+ 1 new > max_len=5"):
        compiled(x[:, 5:6], mask)
    assert_same(cache, snap)
    with pytest.raises(ValueError, match=r"cache overflow: 5 cached \+ 1 new > max_len=5"):
        twin(x[:, 5:6], cache=twin_cache, mask=mask)  # eager: the same error


def test_a_compiled_step_past_max_len_writes_nothing_and_is_reported():
    torch._dynamo.reset()
    attn = MultiHeadAttention(16, 4, 2).eval()
    step = torch.compile(attn, backend="eager", fullgraph=True)
    cache = attn.new_cache(1, 3)
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        step(x[:, :2], cache=cache)
        step(x[:, 2:3], cache=cache)
        snap = snapshot(cache)
        refused = step(x[:, 3:4], cache=cache)  # no host code runs between compiled steps: refused on the device
    torch.testing.assert_close(refused, attn.out_proj.bias.expand_as(refused), rtol=0, atol=0)  # a zero context
    assert torch.equal(cache.keys, snap[0]) and torch.equal(cache.values, snap[1])  # nothing written
    with pytest.raises(ValueError, match=r"cache overflow: 1 compiled step\(s\) found all max_len=3 positions"):
        cache.length  # the next host-side use reports it
    assert_same(cache, snap)  # reported once; the cache is as it was
    cache.reset()
    with torch.no_grad():
        torch.testing.assert_close(step(x[:, :2], cache=cache), attn(x[:, :2], causal=True))


@pytest.mark.timeout(10)
def test_a_cache_too_large_to_allocate_is_a_value_error_naming_its_size():
    with pytest.raises(ValueError, match=r"more than a tensor can hold"):
        KVCache(1, 2**62, 4, 8)
    with pytest.raises(ValueError, match=r"needs 2199023255552 bytes, which could not be allocated"):
        KVCache(1, 2**34, 4, 4)


DYNAMO_SCRIPT = """
import sys, torch, headwise
attn = headwise.MultiHeadAttention(16, 4, 2)
cache = attn.new_cache(batch_size=1, max_len=8)
with torch.no_grad():
    attn(torch.randn(1, 3, 16), cache=cache)
    attn(torch.randn(1, 1, 16), cache=cache)
cpu = "torch._dynamo" in sys.modules
headwise.KVCache(1, 8, 2, 4, device="meta")  # an accelerator's cache is marked for CUDA graphs
print(cpu, "torch._dynamo" in sys.modules)
"""


def test_a_cpu_cache_is_not_marked_for_graphs_and_costs_no_dynamo_import():
    # Marking a cache static for CUDA graphs imports torch._dynamo (about a second); the CPU replays no graphs.
    out = subprocess.run([sys.executable, "-c", DYNAMO_SCRIPT], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr


def test_explaining_a_call_past_max_len_raises_the_forwards_overflow_error():
    from headwise import MultiHeadAttention

    attn = MultiHeadAttention(32, 4, 2).eval()
    cache = attn.new_cache(1, 4)
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        attn(x[:, :4], cache=cache)
        with pytest.raises(ValueError) as forward:
            attn(x[:, 4:6], cache=cache)
        with pytest.raises(ValueError) as explained:
            attn.explain_dispatch(x[:, 4:6], cache=cache)
    assert str(explained.value) == str(forward.value)
    assert cache.length == 4


def _frozen_kv_layer() -> MultiHeadAttention:
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2, dtype=torch.float64)
    for p in (*attn.k_proj.parameters(), *attn.v_proj.parameters()):
        p.requires_grad_(False)  # only W_Q (and W_O) train: the keys and values a step reads carry no history
    return attn


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_backward_through_cached_steps_with_frozen_keys_equals_one_causal_pass(backend):
    # Autograd saves what a step reads; views of the buffers would be changed by the next write.
    attn = _frozen_kv_layer()
    attn.backend = backend
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    want = torch.autograd.grad(attn(x, causal=True)[:, 2:].pow(2).sum(), attn.q_proj.weight)[0]
    cache = attn.new_cache(1, 8)
    ys = [attn(x[:, :2], cache=cache)] + [attn(x[:, t:t + 1], cache=cache) for t in range(2, 5)]
    got = torch.autograd.grad(torch.cat(ys, 1)[:, 2:].pow(2).sum(), attn.q_proj.weight)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not cache.keys.requires_grad
    # A prefill's backward after a later step (not recorded) wrote the cache.
    cache = attn.new_cache(1, 8)
    y = attn(x[:, :4], cache=cache)
    with torch.no_grad():
        attn(x[:, 4:], cache=cache)
    got = torch.autograd.grad(y.pow(2).sum(), attn.q_proj.weight)[0]
    want = torch.autograd.grad(attn(x[:, :4], causal=True).pow(2).sum(), attn.q_proj.weight)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_reset_crop_and_a_rolled_back_write_zero_the_slots_they_drop():
    # A whole-buffer read (compiled steps, half precision on CUDA) masks stale slots out; a NaN there would still
    # poison it (0 * NaN), so dropped slots hold what a new cache holds: zeros.
    cache = filled(KVCache(1, 8, 2, 4), 5)
    cache.crop(2)
    assert cache.length == 2 and not cache.keys[:, :, 2:].any() and not cache.values[:, :, 2:].any()
    snap = snapshot(cache)
    cache.crop(4)  # nothing to drop: no-op
    assert_same(cache, snap)
    cache.keys[:, :, 2:].fill_(float("nan"))  # stale slots, as a write rolled back another way would leave
    cache.reset()
    assert cache.length == 0 and not cache.keys.isnan().any()
    assert torch.equal(cache.keys, torch.zeros_like(cache.keys)) and not cache.values.any()
    # A forward that fails after its write rolls back through crop: its slots are zeroed too.
    attn = MultiHeadAttention(16, 4, 2).eval()
    cache = _filled(attn, 3)
    attn.out_proj.register_forward_hook(lambda *a: 1 / 0)
    with torch.no_grad(), pytest.raises(ZeroDivisionError):
        attn(torch.randn(2, 2, 16), cache=cache)
    assert cache.length == 3 and not cache.keys[:, :, 3:].any()


def test_restore_refuses_a_checkpoint_that_a_crop_or_restore_went_below():
    cache = filled(KVCache(1, 8, 1, 2), 3)
    saved = cache.checkpoint(2)  # at length 3
    filled(cache, 2)
    cache.crop(2)  # below the checkpoint: slot 2 may now be rewritten
    filled(cache, 3)
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"cropped to 2 positions after this checkpoint was taken at length 3"):
        cache.restore(saved)
    assert_same(cache, snap)
    # A crop down to the checkpoint's own length (a failed forward's rollback) keeps it usable.
    cache = filled(KVCache(1, 8, 1, 2), 3)
    snap = snapshot(cache)
    saved = cache.checkpoint(2)
    filled(cache, 2)
    cache.crop(3)
    filled(cache, 1)
    cache.restore(saved)
    assert_same(cache, snap)
    # Restoring an earlier checkpoint goes below a later one.
    first = cache.checkpoint(3)
    filled(cache, 1)
    second = cache.checkpoint(1)
    cache.restore(first)
    filled(cache, 2)
    with pytest.raises(ValueError, match="cropped to 3 positions"):
        cache.restore(second)
    cache.reset()  # a reset forgets the cuts: a checkpoint taken after it restores
    saved = cache.checkpoint(1)
    filled(cache, 1)
    cache.restore(saved)
    assert cache.length == 0


@pytest.mark.parametrize("refusal", ["overflow", "autocast dtype"])
def test_a_refused_first_call_binds_nothing(refusal):
    a, b = MultiHeadAttention(16, 4, 2).eval(), MultiHeadAttention(16, 4, 2).eval()
    cache = KVCache(1, 2, 2, 4)
    with torch.no_grad():
        if refusal == "overflow":
            with pytest.raises(ValueError, match=r"cache overflow: 0 cached \+ 3 new > max_len=2"):
                a(torch.randn(1, 3, 16), cache=cache)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="bfloat16"):
                a(torch.randn(1, 1, 16), cache=cache)
        assert cache.owner is None and cache.length == 0
        b(torch.randn(1, 1, 16), cache=cache)
    assert cache.owner is b


def test_read_mask_and_check_room_name_what_they_expect():
    cache = filled(KVCache(1, 4, 1, 2), 2)
    assert cache.read_mask(2).int().flatten().tolist() == [1, 0, 0, 0, 1, 1, 0, 0]
    assert cache.read_mask(0).shape == (1, 1, 0, 4)
    for bad in (3, -1):
        with pytest.raises(ValueError, match=rf"read_mask: s must be an int from 0 to 2 .*got {bad}"):
            cache.read_mask(bad)
    for bad in (1.0, True, "1"):
        with pytest.raises(TypeError, match=r"read_mask: s must be an int, got"):
            cache.read_mask(bad)
    cache.check_room(2)
    with pytest.raises(ValueError, match=r"cache overflow: 2 cached \+ 3 new > max_len=4"):
        cache.check_room(3)
    with pytest.raises(ValueError, match=r"check_room: n must be a non-negative int, got -9"):
        cache.check_room(-9)
    for bad in ("a", 1.5, None):
        with pytest.raises(TypeError, match=r"check_room: n must be an int, got"):
            cache.check_room(bad)


@pytest.mark.parametrize("device", ["xpu", "mps"])
def test_a_cache_on_a_device_this_machine_lacks_is_refused_as_the_layer_refuses_it(device):
    if (torch.xpu.is_available() if device == "xpu" else torch.backends.mps.is_available()):
        pytest.skip(f"this machine has {device}")
    with pytest.raises(ValueError) as layer:
        MultiHeadAttention(16, 4, device=device)
    with pytest.raises(ValueError) as cache:
        KVCache(1, 4, 4, 4, device=device)
    with pytest.raises(ValueError) as new:
        MultiHeadAttention(16, 4).new_cache(1, 4, device=device)
    assert str(cache.value).startswith(f"device must name an available device (e.g. 'cpu'), got '{device}': ")
    assert str(cache.value) == str(new.value) == str(layer.value)


def test_keys_of_another_dtype_on_a_device_without_autocast_are_a_type_error():
    cache = KVCache(1, 4, 1, 2)
    k = torch.empty(1, 1, 1, 2, dtype=torch.float64, device="meta")  # autocast has no meta device to ask about
    for write in (cache.update, cache.check_update):
        with pytest.raises(TypeError, match=r"^cache holds torch\.float32, got keys of dtype torch\.float64$"):
            write(k, k)
    assert cache.length == 0
    attn = MultiHeadAttention(8, 2, device="meta")
    with pytest.raises(TypeError, match=r"^the cache holds torch\.float64, this layer writes torch\.float32 keys$"):
        attn(torch.empty(1, 1, 8, device="meta"), cache=KVCache(1, 4, 2, 4, dtype=torch.float64, device="meta"))


def test_a_refused_compiled_write_of_several_tokens_says_too_few_positions_were_free():
    cache = filled(KVCache(1, 8, 1, 2), 7)
    snap = snapshot(cache)
    k = torch.randn(1, 1, 2, 2)
    *_, room = cache.write_static(k, k)  # what a compiled step calls (the same code eagerly): 7 + 2 > 8
    assert not bool(room)
    with pytest.raises(ValueError, match=r"^cache overflow: 1 compiled step\(s\) found all max_len=8 positions "
                                         r"written or too few free for their new tokens \(7 written now\) and were "
                                         r"refused \(nothing was written"):
        cache.length
    assert_same(cache, snap)


@pytest.mark.parametrize("owned", [False, True])
def test_under_autocast_explaining_refuses_the_cache_the_forward_refuses(owned):
    attn = MultiHeadAttention(16, 4, 2).eval()
    cache = KVCache(2, 8, 2, 4)  # float32, the weights' dtype: not what the projections write under autocast
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        if owned:
            attn(x, cache=cache)  # outside autocast: binds the cache
        snap = snapshot(cache)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with pytest.raises(TypeError, match="bfloat16"):
                attn(x, cache=cache)
            with pytest.raises(TypeError, match=r"^the cache holds torch\.float32, this layer writes torch\.bfloat16 "
                                                r"keys under torch\.autocast\('cpu', dtype=torch\.bfloat16\)"):
                attn.explain_dispatch(x, cache=cache)
            fits = KVCache(2, 8, 2, 4, dtype=torch.bfloat16)
            assert attn.explain_dispatch(x, cache=fits).scores_shape == (2, 4, 3, 3)  # the dtype written: explained
    assert_same(cache, snap)
    assert cache.owner is (attn if owned else None) and fits.owner is None
