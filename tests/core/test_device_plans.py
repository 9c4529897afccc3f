"""The plan knows the device: its CUDA choices as a pure function, and those plans executed against float64.

``plan_attention`` reads no tensor, so a plan for a CUDA device can be made and checked on a machine without
one; :func:`headwise.functional.attend` then runs such a plan on CPU tensors (the SDPA kernel restriction and
the K/V repeat are plain PyTorch on any device), which proves the arithmetic of every CUDA route in CI.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

import pytest
import torch

from headwise import MultiHeadAttention
from headwise import functional as hwf
from headwise.plan import NO_CUDNN, Causal, Grouping, plan_attention
from tests.reference import reference_heads

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
def test_decode_shaped_half_precision_calls_on_cuda_exclude_cudnn(dtype):
    assert plan(dtype=dtype, s_q=1, s_kv=1025, cached=True).kernels == NO_CUDNN
    assert plan(dtype=dtype, s_q=1, s_kv=1025).kernels == NO_CUDNN  # an interface decode step: no cache object
    assert plan(dtype=dtype, s_q=16, s_kv=1040, cached=True).kernels == NO_CUDNN  # several new tokens
    assert plan(dtype=dtype).kernels is None  # a forward at a fixed shape: PyTorch's choice (cuDNN on Hopper)
    assert plan(CPU, dtype, s_q=1, s_kv=1025, cached=True).kernels is None
    assert plan(dtype=torch.float32, s_q=1, s_kv=1025, cached=True).kernels is None  # cuDNN runs no float32


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

    step = plan(s_q=1, s_kv=1025, cached=True, b=1)
    info = describe(step, d_head=128, n_kv_heads=8, dtype=torch.bfloat16, device=CPU)
    text = " ".join(info.reasons)
    assert "not cuDNN" in text and "query rows of its K/V head" in text
    repeat = describe(plan(dtype=torch.float32, b=1, s_q=64, s_kv=64), d_head=128, n_kv_heads=8,
                      dtype=torch.float32, device=CPU)
    assert "repeated to every query head" in " ".join(repeat.reasons)
    assert "no query chunks on cuda" in " ".join(repeat.reasons)


CASES = {
    "decode, cached": dict(s_q=1, s_kv=9, cached=True),
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


def test_the_kernel_restriction_traces_under_compile():
    torch._dynamo.reset()
    p = plan(CUDA, torch.bfloat16, h=4, h_kv=2, d_h=8, b=2, s_q=1, s_kv=9, cached=True)
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    p = p._replace(grouping=Grouping.KERNEL)  # keep the kernel call itself under the sdpa_kernel context
    compiled = torch.compile(lambda q, k, v: hwf.attend(p, q, k, v)[0], backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v).double(), reference_heads(q, k, v)[0], rtol=1e-4, atol=1e-5)


def test_the_layer_plans_for_its_own_device():
    attn = MultiHeadAttention(64, 8, 2)
    info = attn.explain_dispatch(torch.randn(1, 4, 64))
    assert info.plan.device_type == "cpu" and info.plan.kernels is None
