"""The optional GPU case: bfloat16 on CUDA against flash-attn's ``flash_attn_func`` and PyTorch's SDPA.

It runs only where ``torch.cuda.is_available()``; elsewhere it builds no group and the results say so.
Two kinds of group, both bfloat16:

* the whole forward at case 1's shapes: headwise against the packed SDPA module (the limit);
* the attention step alone: headwise's ``attend`` against ``F.scaled_dot_product_attention`` and, when the
  ``flash_attn`` package imports, ``flash_attn_func`` (which takes ``(b, s, h, d_h)``: its inputs are laid
  out that way before timing, its output is viewed back as ``(b, h, s, d_h)`` for the comparison).

Every timed call ends with a device synchronisation, so the warm-up's calibration and each block measure
finished kernels. ``device="cpu"`` builds the same groups on the CPU (tests use it to check the machinery
and that the entries agree; flash-attn is CUDA-only and is left out there).

Shapes:
    x: (b, s, d); q: (b, h, s, d_h); k, v: (b, h_kv, s, d_h).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F

from headwise import MultiHeadAttention
from . import peers
from .timing import Entry, Group, forward_flops

__all__ = ["gpu_groups", "gpu_device", "flash_attn_func_or_reason"]

DTYPE = torch.bfloat16
#: bf16 peers agree with headwise to bf16 rounding (8 mantissa bits): |diff| <= 1e-2 + 2e-2 * max|out|.
TOL = (2e-2, 1e-2)


def gpu_device() -> str | None:
    """``"cuda"`` where PyTorch sees a CUDA device, else None (the case is skipped)."""
    return "cuda" if torch.cuda.is_available() else None


def flash_attn_func_or_reason() -> tuple[Callable | None, str]:
    """flash-attn's ``flash_attn_func`` and its version, or None and why it is unavailable."""
    try:
        import flash_attn
        from flash_attn import flash_attn_func
    except Exception as exc:  # not installed, or built for another torch/CUDA
        return None, f"flash-attn unavailable ({type(exc).__name__}: {exc})"
    return flash_attn_func, f"flash-attn {getattr(flash_attn, '__version__', '?')}"


def _synced(fn: Callable[[], Any], device: str) -> Callable[[], Any]:
    if device != "cuda":
        return fn

    def g() -> Any:
        out = fn()
        torch.cuda.synchronize()
        return out
    return g


def _no_grad(fn: Callable[[], Any]) -> Callable[[], Any]:
    def g() -> Any:
        with torch.no_grad():
            return fn()
    return g


def _forward_group(sz, shape: tuple[int, int, int, int], causal: bool, device: str) -> Group:
    b, s, d, h = shape
    torch.manual_seed(0)
    attn = MultiHeadAttention(d, h, device=device, dtype=DTYPE).eval()
    packed = peers.PackedSDPA(attn).to(device=device, dtype=DTYPE).eval()
    x = torch.randn(b, s, d, device=device, dtype=DTYPE)
    es = [Entry("headwise", _synced(_no_grad(lambda: attn(x, causal=causal)), device), role="headwise"),
          Entry("packed SDPA (limit)", _synced(_no_grad(lambda: packed(x, causal=causal)), device), role="limit")]
    cfg = attn.config
    flops = forward_flops(b, s, d, cfg.inner_dim, cfg.kv_dim, causal)
    return Group("gpu forward", f"gpu bf16 fwd b{b} s{s} d{d} h{h} {'causal' if causal else 'full'}", es,
                 rounds=sz.rounds, block_s=sz.block_s, tol=TOL, flops=flops,
                 meta={"b": b, "s": s, "d": d, "h": h, "causal": causal, "device": device, "dtype": "bfloat16"})


def _step_group(sz, step: tuple[int, int, int, int, int], causal: bool, device: str) -> Group:
    b, h, h_kv, s, d_h = step
    torch.manual_seed(0)
    attn = MultiHeadAttention(h * d_h, h, h_kv, device=device, dtype=DTYPE).eval()
    q = torch.randn(b, h, s, d_h, device=device, dtype=DTYPE)
    k, v = (torch.randn(b, h_kv, s, d_h, device=device, dtype=DTYPE) for _ in range(2))
    scale = attn.config.scale
    es = [Entry("headwise attend", _synced(_no_grad(lambda: attn.attend(q, k, v, causal=causal)[0]), device),
                role="headwise"),
          Entry("SDPA", _synced(_no_grad(lambda: F.scaled_dot_product_attention(
              q, k, v, is_causal=causal, scale=scale, enable_gqa=h != h_kv)), device))]
    notes = []
    flash, about = flash_attn_func_or_reason()
    if flash is not None and device == "cuda":
        q2, k2, v2 = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # (b, s, heads, d_h), untimed
        es.append(Entry("flash_attn_func", _synced(_no_grad(lambda: flash(
            q2, k2, v2, softmax_scale=scale, causal=causal).transpose(1, 2)), device), note=about))
    else:
        notes.append(f"flash_attn_func not timed: {about if flash is None else 'CUDA only'}")
    flops = 4.0 * b * s * s * h * d_h * (0.5 if causal else 1.0)
    return Group("gpu attention step", f"gpu bf16 attention b{b} h{h} h_kv{h_kv} s{s} d_h{d_h} "
                 f"{'causal' if causal else 'full'}", es, rounds=sz.rounds, block_s=sz.block_s, tol=TOL, flops=flops,
                 meta={"b": b, "h": h, "h_kv": h_kv, "s": s, "d_h": d_h, "causal": causal, "device": device},
                 notes=notes)


def gpu_groups(sz, *, device: str | None = None) -> list:
    """Factories of the GPU groups; none without CUDA unless ``device`` is given (``"cpu"`` for tests)."""
    device = device or gpu_device()
    if device is None:
        return []
    out = [partial(_forward_group, sz, shape, causal, device) for shape in sz.forward for causal in (False, True)]
    out += [partial(_step_group, sz, step, causal, device) for step in sz.gpu_step for causal in (False, True)]
    return out
