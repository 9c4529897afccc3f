"""The plan knows the device: its CUDA choices as a pure function, and those plans executed against float64.

``plan_attention`` reads no tensor, so a plan for a CUDA device can be made and checked on a machine without
one; :func:`headwise.functional.attend` then runs such a plan on CPU tensors (the SDPA kernel restriction and
the K/V repeat are plain PyTorch on any device), which proves the arithmetic of every CUDA route in CI.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import headwise
import headwise.attention
import headwise.call_plan
import headwise.token_step
from headwise import DecodeStep, MultiHeadAttention
from headwise import functional as hwf
from headwise.plan import CacheRead, Causal, Grouping, cache_read, plan_attention
from tests.reference import reference_heads, reference_mha

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def plan(device=CUDA, dtype=torch.bfloat16, h=32, h_kv=8, d_h=128, b=8, s_q=4096, s_kv=4096, **kw):
    return plan_attention(h=h, h_kv=h_kv, d_h=d_h, scale=d_h ** -0.5, b=b, s_q=s_q, s_kv=s_kv, dtype=dtype,
                          device=device, **kw)


def test_long_inference_forwards_are_chunked_on_cpu_only():
    big = dict(b=1, s_q=32768, s_kv=32768, causal=True)  # 2 GiB of Q, K, V and context in float32
    assert plan(CPU, torch.float32, **big).chunk is not None
    for dtype in (torch.float32, torch.bfloat16):
        assert plan(CUDA, dtype, **big).chunk is None  # flash / cuDNN / efficient already hold O(s) memory
        assert plan(CUDA, dtype, **big).causal_via is Causal.KERNEL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_growing_keys_in_half_precision_on_cuda_avoid_cudnn_and_whole_buffers_do_not(dtype):
    assert plan(dtype=dtype, s_q=1, s_kv=1025, cached=True, read=CacheRead.PREFIX).avoid_cudnn
    assert plan(dtype=dtype, s_q=1, s_kv=1025).avoid_cudnn  # an interface decode step: transformers' cache
    assert plan(dtype=dtype, s_q=16, s_kv=1040, cached=True, read=CacheRead.PREFIX).avoid_cudnn
    whole = plan(dtype=dtype, s_q=1, s_kv=2048, cached=True, has_mask=True, read=CacheRead.BUFFER)
    assert not whole.avoid_cudnn and whole.causal_via is Causal.NONE  # one shape for every position: one plan
    assert not plan(dtype=dtype).avoid_cudnn  # a forward at a fixed shape: PyTorch's choice (cuDNN on Hopper)
    assert not plan(CPU, dtype, s_q=1, s_kv=1025, cached=True).avoid_cudnn
    assert not plan(dtype=torch.float32, s_q=1, s_kv=1025, cached=True).avoid_cudnn  # cuDNN runs no float32


def test_cache_reads_per_device():
    length = lambda: 1024  # noqa: E731
    assert cache_read("cuda", torch.bfloat16, 1, False, False, length) is CacheRead.BUFFER
    assert cache_read("cuda", torch.float16, 8, False, False, length) is CacheRead.BUFFER
    assert cache_read("cuda", torch.bfloat16, 128, False, False, lambda: 0) is CacheRead.PREFIX  # a first prefill
    assert cache_read("cuda", torch.float32, 1, False, False, length) is CacheRead.PREFIX  # no cuDNN in float32
    assert cache_read("cpu", torch.bfloat16, 1, False, False, length) is CacheRead.PREFIX
    assert cache_read("cuda", torch.bfloat16, 1, True, False, length) is CacheRead.PREFIX  # a user mask
    assert cache_read("cuda", torch.bfloat16, 1, False, True, length) is CacheRead.PREFIX  # weights returned


def test_gqa_is_grouped_the_way_the_best_cuda_kernel_can_run_it():
    assert plan(dtype=torch.float32).grouping is Grouping.REPEAT  # efficient kernel: no GQA, math otherwise
    assert plan(dtype=torch.bfloat16).grouping is Grouping.KERNEL  # flash groups heads itself
    assert plan(dtype=torch.bfloat16, has_mask=True).grouping is Grouping.REPEAT  # a mask: efficient again
    assert plan(dtype=torch.bfloat16, s_q=5, s_kv=9, causal=True).grouping is Grouping.REPEAT  # explicit mask
    assert plan(dtype=torch.float32, s_q=1, s_kv=9, cached=True).grouping is Grouping.FOLD
    assert plan(dtype=torch.float32, s_q=1, s_kv=9, has_mask=True).grouping is Grouping.FOLD
    per_head = dict(s_q=1, s_kv=9, has_mask=True, mask_per_head=True)  # a mask that differs within a group
    assert plan(dtype=torch.float32, **per_head).grouping is Grouping.REPEAT
    assert plan(CPU, torch.float32, **per_head).grouping is Grouping.KERNEL
    assert plan(CPU, torch.float32).grouping is Grouping.KERNEL  # the CPU flash kernel groups heads itself
    assert plan(dtype=torch.float32, h_kv=32).grouping is Grouping.NONE


def test_dead_rows_are_zeroed_by_headwise_wherever_a_row_may_read_nothing():
    assert plan(has_mask=True).zero_dead_rows
    assert plan(s_q=8, s_kv=4, causal=True).zero_dead_rows  # bottom-right: the first four rows read nothing
    assert not plan(causal=True).zero_dead_rows and not plan().zero_dead_rows
    assert not plan(has_mask=True, return_weights=True).zero_dead_rows  # the eager formula zeros them itself


def test_explain_dispatch_says_why_for_each_device_choice():
    from headwise.dispatch import describe

    step = plan(s_q=1, s_kv=1025, cached=True, b=1, read=CacheRead.PREFIX)
    info = describe(step, d_head=128, n_kv_heads=8, dtype=torch.bfloat16, device=CPU)
    text = " ".join(info.reasons)
    assert "may not use cuDNN" in text and "query rows of its K/V head" in text
    whole = plan(s_q=1, s_kv=2048, cached=True, b=1, has_mask=True, read=CacheRead.BUFFER)
    text = " ".join(describe(whole, d_head=128, n_kv_heads=8, dtype=torch.bfloat16, device=CPU).reasons)
    assert "one execution plan per cache" in text
    repeat = describe(plan(dtype=torch.float32, b=1, s_q=64, s_kv=64), d_head=128, n_kv_heads=8,
                      dtype=torch.float32, device=CPU)
    assert "repeated to every query head" in " ".join(repeat.reasons)
    assert "no query chunks on cuda" in " ".join(repeat.reasons)


CASES = {
    "decode, cached": dict(s_q=1, s_kv=9, cached=True, read=CacheRead.PREFIX),
    "decode, mask": dict(s_q=1, s_kv=9, mask=True),
    "prefill, causal": dict(s_q=7, s_kv=7, causal=True),
    "chunk, causal": dict(s_q=3, s_kv=9, causal=True),
    "mask": dict(s_q=7, s_kv=9, mask=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("h_kv", [4, 2, 1])
def test_cuda_plans_run_on_cpu_tensors_match_float64(dtype, case, h_kv):
    c = dict(CASES[case])
    b, h, d_h = 2, 4, 8
    s_q, s_kv = c.pop("s_q"), c.pop("s_kv")
    q = torch.randn(b, h, s_q, d_h, dtype=dtype)
    k, v = torch.randn(b, h_kv, s_kv, d_h, dtype=dtype), torch.randn(b, h_kv, s_kv, d_h, dtype=dtype)
    mask = None
    if c.pop("mask", False):
        mask = torch.rand(b, 1, s_q, s_kv) > 0.4
        mask[1, :, 0] = False  # a dead row: zeros by headwise
    p = plan_attention(h=h, h_kv=h_kv, d_h=d_h, scale=d_h ** -0.5, b=b, s_q=s_q, s_kv=s_kv, dtype=dtype,
                       device=CUDA, has_mask=mask is not None, **c)
    z, _ = hwf.attend(p, q, k, v, mask)
    ref, _ = reference_heads(q, k, v, mask=mask, causal=p.causal)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(z.double(), ref, **tol)


def test_avoiding_cudnn_leaves_pytorchs_switches_as_they_were(monkeypatch):
    p = plan(CUDA, torch.bfloat16, h=4, h_kv=2, d_h=8, b=2, s_q=1, s_kv=9, cached=True, read=CacheRead.PREFIX)
    assert p.avoid_cudnn
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    before = [torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
              torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()]
    z, _ = hwf.attend(p, q, k, v)
    assert seen == [False] and before[3]  # cuDNN off for the call...
    assert before == [torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                      torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()]  # ...only
    torch.testing.assert_close(z.double(), reference_heads(q, k, v)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("h_kv, rotary", [(4, False), (2, True)])
def test_the_whole_buffer_route_equals_the_prefix_route(monkeypatch, h_kv, rotary):
    """CacheRead.BUFFER (CUDA, half precision) taken on the CPU: the forward, DecodeStep and the decode-after-
    prefill path read the whole buffer under the filled-positions mask and give the prefix route's answer."""
    from headwise import RotaryEmbedding

    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4, h_kv, rotary=RotaryEmbedding(8) if rotary else None).eval()
    x = torch.randn(2, 14, 32)
    cache = attn.new_cache(2, 20)
    whole = lambda device_type, dtype, s_q, has_mask, eager, length: (  # noqa: E731
        CacheRead.PREFIX if has_mask or eager or (s_q > 1 and length() == 0) else CacheRead.BUFFER)
    monkeypatch.setattr(headwise.call_plan, "cache_read", whole)
    monkeypatch.setattr(headwise.token_step, "cache_read", whole)
    step = DecodeStep(attn, cache)
    with torch.no_grad():
        assert attn.explain_dispatch(x[:, :1], cache=cache).plan.cache_read is CacheRead.BUFFER
        got = [attn(x[:, :6], cache=cache), attn(x[:, 6:9], cache=cache)]  # a prefill, then an append of three
        got += [step(x[:, t:t + 1]) for t in range(9, 14)]
    ref, _ = reference_mha(attn, x, causal=True)
    torch.testing.assert_close(torch.cat(got, 1).double(), ref, rtol=1e-4, atol=1e-5)


def test_the_layer_plans_for_its_own_device():
    attn = MultiHeadAttention(64, 8, 2)
    info = attn.explain_dispatch(torch.randn(1, 4, 64))
    assert info.plan.device_type == "cpu" and not info.plan.avoid_cudnn


_PLAN_FORWARD = MultiHeadAttention.forward.__globals__["plan_forward"]


def _cuda_input(dtype, s_q):
    """What plan_forward reads of x for a CUDA call (no tensor is made): its device, dtype, shape and grad flag."""
    return SimpleNamespace(device=CUDA, dtype=dtype, shape=(1, s_q, 64), requires_grad=False)


def test_under_autocast_the_layer_plans_for_the_dtype_its_attention_runs_in():
    attn = MultiHeadAttention(64, 8, 2).eval()
    cache = attn.new_cache(1, 64, dtype=torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        attn(torch.randn(1, 10, 64), cache=cache)
    was = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    # torch.autocast("cuda") turns itself off without CUDA; its switches are what the layer reads.
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        with torch.no_grad():
            steps = [_PLAN_FORWARD(attn, _cuda_input(torch.float32, s_q), None, None, False, cache, False,
                                   backend="sdpa", chunk_queries=True) for s_q in (1, 4)]
    finally:
        torch.set_autocast_enabled("cuda", was[0])
        torch.set_autocast_dtype("cuda", was[1])
    with torch.no_grad():  # the kernel gets bfloat16 q, k, v: the plan of a bfloat16 call without autocast
        expected = [_PLAN_FORWARD(attn, _cuda_input(torch.bfloat16, s_q), None, None, False, cache, False,
                                  backend="sdpa", chunk_queries=True) for s_q in (1, 4)]
    assert steps == expected
    assert [p.cache_read for p in steps] == [CacheRead.BUFFER, CacheRead.BUFFER]  # one shape: one cuDNN plan
    x = torch.randn(2, 64, 64)
    attn.chunk_queries = 8
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            on_cpu = attn.explain_dispatch(x, causal=True)
        half = copy.deepcopy(attn).to(torch.bfloat16).explain_dispatch(x.bfloat16(), causal=True)
    assert on_cpu.plan == half.plan and on_cpu.plan.chunk == 8  # chunks merged by a mask: no bfloat16 lse merge
    assert on_cpu.kernel == half.kernel


def test_a_traced_eager_decode_step_reads_the_filled_prefix_for_its_statistics(monkeypatch):
    torch.manual_seed(0)
    attn = MultiHeadAttention(64, 4, 2).eval()
    cache = attn.new_cache(1, 16)
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        attn(x[:, :4], cache=cache)
        step = _PLAN_FORWARD(attn, _cuda_input(torch.bfloat16, 1), None, None, False, cache, False,
                             backend="sdpa", chunk_queries=False, statistics=("key_weight",))
    assert step.cache_read is CacheRead.PREFIX and step.shape == (1, 4, 1, 5)
    # That route run on CPU tensors: the CUDA half-precision rule, as test_the_whole_buffer_route_... takes it.
    whole = lambda device_type, dtype, s_q, has_mask, eager, length: (  # noqa: E731
        CacheRead.PREFIX if has_mask or eager or (s_q > 1 and length() == 0) else CacheRead.BUFFER)
    monkeypatch.setattr(headwise.call_plan, "cache_read", whole)
    with torch.no_grad(), headwise.trace(attn, capture=["key_weight"]) as t:
        attn(x[:, 4:5], cache=cache)
    _, weights = reference_mha(attn, x, causal=True)  # (1, h, 5, 5): the step is the last query
    torch.testing.assert_close(t[0].calls[0]["key_weight"].double(), weights[:, :, -1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("capture", [["pattern"], ["result"], ["entropy", "key_weight"]])
def test_inside_a_trace_explain_dispatch_gives_the_plan_the_forward_runs(monkeypatch, capture):
    attn = MultiHeadAttention(32, 4, 2).eval()
    attn.chunk_queries = 2  # chunks of two positions, wherever the plan may chunk
    x = torch.randn(1, 6, 32)
    ran = []
    planned = MultiHeadAttention.forward.__globals__["plan_forward"]
    monkeypatch.setitem(MultiHeadAttention.forward.__globals__, "plan_forward",
                        lambda *a, **k: ran.append(planned(*a, **k)) or ran[-1])
    with torch.no_grad(), headwise.trace(attn, capture=capture):
        explained = attn.explain_dispatch(x, causal=True)
        attn(x, causal=True)
    assert explained.plan == ran[-1]
    assert explained.query_chunk is None  # a trace sees each call whole
    assert (explained.backend == "eager") == (capture == ["pattern"])
    with torch.no_grad():
        assert attn.explain_dispatch(x, causal=True).query_chunk == 2  # outside the trace: chunks again
