"""On a CUDA device, with PyTorch's default kernels (cuDNN, flash, memory-efficient): every path against float64.

Run with ``pytest -m cuda tests`` on a machine with a GPU (docs/gpu.md); CI has none, so each test here skips
with a one-line reason. The references are the same float64 per-head formula as on CPU (tests/reference.py),
computed on the device in float64.

Shapes:
    b: batch, s: sequence, d: model width, h: query heads, h_kv: key/value heads.
"""

from __future__ import annotations

import copy

import pytest
import torch

from headwise import DecodeStep, MultiHeadAttention, RotaryEmbedding
from headwise import masks as hwm
from tests.reference import reference_mha as reference_on_cpu

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: (rtol, atol) against float64 (tests/TOLERANCES.md: the bfloat16 layer row covers both half precisions).
TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (5e-2, 5e-2), torch.float16: (5e-2, 5e-2)}


def _layer(d: int, h: int, h_kv: int, dtype: torch.dtype, rotary: bool = False) -> MultiHeadAttention:
    torch.manual_seed(0)
    rope = RotaryEmbedding(d // h) if rotary else None
    return MultiHeadAttention(d, h, h_kv, rotary=rope, device="cuda", dtype=dtype).eval()


def reference_mha(attn: MultiHeadAttention, x: torch.Tensor, context: torch.Tensor | None = None,
                  **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 formula on the CPU (tests/reference.py), from a CPU copy of the layer and inputs."""
    cpu = copy.deepcopy(attn).cpu()
    kw = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return reference_on_cpu(cpu, x.cpu(), None if context is None else context.cpu(), **kw)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOL[dtype]
    ref = ref.to(got.device)
    torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol * max(1.0, float(ref.abs().max())))


def _padding(b: int, s: int) -> torch.Tensor:
    keep = torch.ones(b, s, dtype=torch.bool, device="cuda")
    keep[0, :3] = False  # left padding: rows 0..2 of sequence 0 read nothing under causal masking
    keep[-1] = False  # the last sequence is all padding
    return hwm.combine_masks(hwm.padding_mask(keep=keep), hwm.causal_mask(s, device="cuda"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h_kv", [8, 2, 1])
@pytest.mark.parametrize("kind", ["causal", "padding with dead rows", "float bias", "cross", "causal s_q > s_kv"])
def test_forward_matches_float64(dtype, h_kv, kind):
    attn = _layer(128, 8, h_kv, dtype)
    x = torch.randn(3, 192, 128, device="cuda", dtype=dtype)
    kw: dict = {}
    if kind == "causal":
        kw["causal"] = True
    elif kind == "padding with dead rows":
        kw["mask"] = _padding(3, 192)
    elif kind == "float bias":
        kw["mask"] = torch.randn(3, 1, 192, 192, device="cuda", dtype=dtype)
    elif kind == "cross":
        kw["context"] = torch.randn(3, 80, 128, device="cuda", dtype=dtype)
    else:
        kw.update(causal=True, context=torch.randn(3, 100, 128, device="cuda", dtype=dtype))
    with torch.no_grad():
        got = attn(x, **kw)
    ref, _ = reference_mha(attn, x, kw.get("context"), mask=kw.get("mask"), causal=kw.get("causal", False))
    _close(got, ref, dtype)
    if kind == "padding with dead rows":  # zeros before W_O: the output is W_O's bias there, on every kernel
        torch.testing.assert_close(got[-1], attn.out_proj.bias.expand(192, -1), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h_kv, rotary", [(8, False), (2, True), (1, False)])
def test_prefill_and_decode_steps_match_the_causal_forward_and_float64(dtype, h_kv, rotary):
    attn = _layer(128, 8, h_kv, dtype, rotary)
    x = torch.randn(2, 96, 128, device="cuda", dtype=dtype)
    cache = attn.new_cache(2, 128)
    step = DecodeStep(attn, cache)
    with torch.no_grad():
        got = torch.cat([attn(x[:, :64], cache=cache)] + [step(x[:, t:t + 1]) for t in range(64, 96)], 1)
    ref, _ = reference_mha(attn, x, causal=True)
    _close(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h_kv", [8, 2])
def test_gradients_match_float64(dtype, h_kv):
    attn = _layer(128, 8, h_kv, dtype).train()
    x = torch.randn(2, 130, 128, device="cuda", dtype=dtype, requires_grad=True)
    mask = _padding(2, 130)
    (gx, gw) = torch.autograd.grad(attn(x, mask=mask).float().square().sum(), (x, attn.q_proj.weight))
    x64 = x.detach().cpu().double().requires_grad_()
    ref, _ = reference_on_cpu(copy.deepcopy(attn).cpu(), x64, mask=mask.cpu())
    (rx,) = torch.autograd.grad(ref.square().sum(), x64)
    assert torch.isfinite(gx).all() and torch.isfinite(gw).all()
    _close(gx, rx, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_reduce_overhead_step_records_once_and_equals_eager(dtype):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    attn = _layer(256, 8, 2, dtype, rotary=True)
    x = torch.randn(4, 100, 256, device="cuda", dtype=dtype)
    cache, twin = attn.new_cache(4, 128), attn.new_cache(4, 128)
    compiled = torch.compile(DecodeStep(attn, cache), mode="reduce-overhead", fullgraph=True)
    eager = DecodeStep(attn, twin)
    with torch.no_grad():
        attn(x[:, :16], cache=cache)
        attn(x[:, :16], cache=twin)
        got = torch.cat([compiled(x[:, t:t + 1]).clone() for t in range(16, 100)], 1)
        want = torch.cat([eager(x[:, t:t + 1]) for t in range(16, 100)], 1)
    assert counters["stats"]["unique_graphs"] == 1  # one graph for 84 positions
    assert not counters["inductor"]["cudagraph_skips"]  # ...run as a CUDA graph
    rtol, atol = (1e-4, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert cache.length == twin.length == 100
