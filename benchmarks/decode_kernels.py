"""``python -m benchmarks.decode_kernels``: what a one-query decode step's attention costs on CUDA with each
SDPA kernel and cache layout, the measurements behind headwise's decode plan (docs/gpu.md).

For b in (1, 16), a 1024-token filled cache of 8 K/V heads (d_h 128, 32 query heads, bfloat16), and a buffer of
``max_len`` positions, each variant's attention is timed alone: inside a CUDA graph of 50 calls (device time
only) and as 50 eager calls (what the host adds). Variants: the filled prefix or the whole buffer under a
position mask; SDPA's ``enable_gqa`` or the group's query heads folded into rows; flash, memory-efficient,
cuDNN (its per-shape plan already built: a "seen" length) and math. Then one whole step of headwise's
``DecodeStep`` and of the plain loop, profiled (device time per step against wall time per step).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B = SDPBackend


def _time(fn: Callable[[], object], n: int = 50) -> tuple[float, float]:
    """(device ms per call inside a CUDA graph, wall ms per call eager); nan where capture fails."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t0) / n * 1e3
    graph_ms = float("nan")
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(n):
                fn()
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        graph_ms = start.elapsed_time(end) / (5 * n)
    except Exception as exc:  # a kernel that cannot be captured: report eager only
        print(f"    (no CUDA graph: {type(exc).__name__}: {str(exc).splitlines()[0][:80]})")
    return graph_ms, eager


def attention_variants(b: int, fill: int = 1024, max_len: int = 1280) -> None:
    h, h_kv, d_h, dt = 32, 8, 128, torch.bfloat16
    g = h // h_kv
    q = torch.randn(b, h, 1, d_h, device="cuda", dtype=dt)
    qf = q.view(b, h_kv, g, d_h)
    k = torch.randn(b, h_kv, max_len, d_h, device="cuda", dtype=dt)
    v = torch.randn_like(k)
    kp, vp = k[:, :, :fill], v[:, :, :fill]
    mask = (torch.arange(max_len, device="cuda") < fill).view(1, 1, 1, max_len)
    cases = {
        "flash, enable_gqa, prefix": ([B.FLASH_ATTENTION], lambda: F.scaled_dot_product_attention(q, kp, vp, enable_gqa=True)),
        "flash, fold, prefix": ([B.FLASH_ATTENTION], lambda: F.scaled_dot_product_attention(qf, kp, vp)),
        "efficient, fold, prefix": ([B.EFFICIENT_ATTENTION], lambda: F.scaled_dot_product_attention(qf, kp, vp)),
        "math, fold, prefix": ([B.MATH], lambda: F.scaled_dot_product_attention(qf, kp, vp)),
        "cudnn, enable_gqa, prefix (seen)": ([B.CUDNN_ATTENTION], lambda: F.scaled_dot_product_attention(q, kp, vp, enable_gqa=True)),
        "cudnn, fold, prefix (seen)": ([B.CUDNN_ATTENTION], lambda: F.scaled_dot_product_attention(qf, kp, vp)),
        "cudnn, fold, buffer + mask": ([B.CUDNN_ATTENTION], lambda: F.scaled_dot_product_attention(qf, k, v, attn_mask=mask)),
        "cudnn, enable_gqa, buffer + mask": ([B.CUDNN_ATTENTION], lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)),
        "efficient, fold, buffer + mask": ([B.EFFICIENT_ATTENTION], lambda: F.scaled_dot_product_attention(qf, k, v, attn_mask=mask)),
        "default, fold, buffer + mask": (None, lambda: F.scaled_dot_product_attention(qf, k, v, attn_mask=mask)),
    }
    print(f"attention alone, b{b}, {fill} of {max_len} positions filled:   graph ms   eager ms")
    for name, (kernels, fn) in cases.items():
        try:
            if kernels is None:
                dev, eager = _time(fn)
            else:
                with sdpa_kernel(kernels):
                    dev, eager = _time(fn)
            print(f"  {name:40} {dev:8.4f}  {eager:8.4f}")
        except Exception as exc:
            print(f"  {name:40} refused: {str(exc).splitlines()[0][:100]}")


def step_profiles(b: int) -> None:
    from headwise import DecodeStep, MultiHeadAttention

    from .peers import XWDecoder

    torch.manual_seed(0)
    attn = MultiHeadAttention(4096, 32, 8, bias=False, device="cuda", dtype=torch.bfloat16).eval()
    cache = attn.new_cache(b, 1400)
    step = DecodeStep(attn, cache)
    nc = XWDecoder(attn, b, 1400, kernels=[B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH])
    x = torch.randn(b, 1, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        prompt = torch.randn(b, 1024, 4096, device="cuda", dtype=torch.bfloat16)
        attn(prompt, cache=cache)
        kv = [p(prompt).view(b, 1024, attn.n_kv_heads, attn.d_head).transpose(1, 2) for p in (attn.k_proj, attn.v_proj)]
    for name, fn, reset in (("headwise DecodeStep", lambda: step(x), lambda: cache.crop(1024)),
                            ("plain loop, cuDNN excluded", lambda: nc(x), lambda: nc.fill(*kv))):
        with torch.no_grad():
            reset()
            for _ in range(5):
                fn()
            reset()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                for _ in range(40):
                    fn()
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) / 40 * 1e3
        events = [e for e in prof.key_averages() if _device_us(e) > 0]
        device = sum(_device_us(e) for e in events) / 40 / 1e3
        print(f"step b{b} {name}: wall {wall:.3f} ms/step (profiled), device {device:.3f} ms/step, "
              f"{sum(e.count for e in events) / 40:.1f} kernels/step")
        for e in sorted(events, key=lambda e: -_device_us(e))[:6]:
            print(f"    {_device_us(e) / 40 / 1e3:.4f} ms  x{e.count / 40:.0f}  {e.key[:90]}")


def _device_us(event: object) -> float:
    """An averaged profiler event's own device time (microseconds), whatever this PyTorch calls it."""
    return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    for b in (1, 16):
        attention_variants(b)
        attention_variants(b, max_len=2048)
    for b in (1, 16):
        step_profiles(b)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
