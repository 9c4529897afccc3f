"""On a CUDA device with Triton: the statistics kernel (headwise/statistics/kernel.py, compiled for the GPU) against
float64 statistics of the materialised pattern (tests/trace/stats_reference.py), at small shapes, in float32,
bfloat16 and float16; and a traced layer and a patched Llama on the device taking the kernel's path.

Run with ``pytest -m cuda tests/gpu`` on a machine with a GPU (docs/gpu.md); CI has none, so each test here skips
with a one-line reason.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import headwise
from headwise import plan as hwp
from headwise.statistics import STATISTICS, KernelFallbackWarning
from tests.trace.stats_reference import close, reference_statistics

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)"),
              pytest.mark.skipif(not hwp.statistics_kernel_available(), reason="needs triton (the kernel's compiler)")]

#: (rtol, atol) of the statistics and of the context against float64 (tests/TOLERANCES.md, the GPU statistics
#: rows): scores are float32 products of inputs rounded to the dtype (the reference uses the same rounded
#: inputs); half-precision probabilities enter the value product.
STATS_TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-3, 2e-3), torch.float16: (2e-3, 2e-3)}
Z_TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (3e-2, 3e-2), torch.float16: (1e-2, 1e-2)}


def _inputs(b: int, h: int, h_kv: int, s_q: int, s_kv: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=g, device="cuda").to(dtype)
            for n, s in ((h, s_q), (h_kv, s_kv), (h_kv, s_kv))]


def _padding(b: int, s: int) -> torch.Tensor:
    keep = torch.ones(b, s, dtype=torch.bool, device="cuda")
    keep[0, :5] = False  # left padding: under causal masking rows 0..4 of sequence 0 read nothing
    keep[-1, s - 7:] = False
    return headwise.masks.padding_mask(keep=keep)  # (b, 1, 1, s)


def _window(s: int, w: int) -> torch.Tensor:
    i, j = torch.arange(s, device="cuda")[:, None], torch.arange(s, device="cuda")[None, :]
    return ((j <= i) & (j > i - w)).view(1, 1, s, s)


KINDS = ["causal", "padding, causal", "window", "softcap", "sinks", "float mask", "s_q < s_kv"]
# Every kind in bfloat16 at a Llama head (d_h 128, GQA); the other dtypes at d_h 64 without GQA. Each case compiles
# its own kernels (a few seconds of GPU time each), so the grid is kept small.
CASES = ([(kind, torch.bfloat16, 128, 2) for kind in KINDS]
         + [(kind, dtype, 64, 8) for dtype in (torch.float32, torch.float16) for kind in ("causal", "padding, causal")])


@pytest.mark.parametrize("kind, dtype, d, h_kv", CASES, ids=[f"{c[0]}-{str(c[1])[6:]}-d{c[2]}" for c in CASES])
def test_the_kernel_equals_float64_of_the_pattern(kind, dtype, d, h_kv):
    from headwise.statistics.kernel import kernel_statistics

    b, h, s_q, s_kv = 2, 8, 200, 200
    kw: dict = {"causal": True}
    if kind == "padding, causal":
        kw["mask"] = _padding(b, s_kv)
    elif kind == "window":
        kw = {"mask": _window(s_kv, 37)}
    elif kind == "softcap":
        kw["softcap"] = 3.0
    elif kind == "sinks":
        kw["sinks"] = torch.randn(h, device="cuda").to(dtype)
    elif kind == "float mask":
        kw = {"mask": torch.randn(b, 1, s_q, s_kv, device="cuda").to(dtype)}
    elif kind == "s_q < s_kv":
        s_q = 77
    q, k, v = _inputs(b, h, h_kv, s_q, s_kv, d, dtype)
    z, got = kernel_statistics(q, k, v, scale=d ** -0.5, **kw)
    cpu = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    want_z, want = reference_statistics(q.cpu(), k.cpu(), v.cpu(), scale=d ** -0.5, **cpu)
    close(got, want, *STATS_TOL[dtype])
    rtol, atol = Z_TOL[dtype]
    torch.testing.assert_close(z.double().cpu(), want_z, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_traced_layer_on_the_device_takes_the_kernel_and_keeps_its_output(dtype):
    torch.manual_seed(0)
    attn = headwise.MultiHeadAttention(512, 8, 2, device="cuda", dtype=dtype).eval()
    x = torch.randn(2, 300, 512, device="cuda", dtype=dtype)
    with torch.no_grad():
        info = attn.explain_dispatch(x, causal=True, statistics=STATISTICS)
        plain = attn(x, causal=True)
        with warnings.catch_warnings(), headwise.trace(attn, capture=STATISTICS + ("q", "k", "v")) as t:
            warnings.simplefilter("error", KernelFallbackWarning)
            traced = attn(x, causal=True)
    assert (info.backend, info.kernel) == ("statistics", "triton")
    rtol, atol = Z_TOL[dtype]
    torch.testing.assert_close(traced.float(), plain.float(), rtol=rtol, atol=atol)
    r = t[0]
    _, want = reference_statistics(r.q.cpu(), r.k.cpu(), r.v.cpu(), scale=attn.config.scale, causal=True)
    close({n: getattr(r, n) for n in STATISTICS}, want, *STATS_TOL[dtype])


def test_a_patched_llama_generates_with_the_kernel_and_its_statistics_are_each_keys_total():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = headwise.interop.patch(transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval())
    ids = torch.randint(3, 64, (2, 40), device="cuda")
    with torch.no_grad(), warnings.catch_warnings(), headwise.trace(model, capture=STATISTICS) as t:
        warnings.simplefilter("error", KernelFallbackWarning)
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad(), headwise.trace(model, capture=STATISTICS) as forced:
        model(out[:, :-1])
    for i in range(len(t)):  # bfloat16 projections of one token or of the whole sequence round differently
        close({n: getattr(t[i], n) for n in STATISTICS}, {n: getattr(forced[i], n).double() for n in STATISTICS},
              3e-2, 3e-2)
    kw = t[0].key_weight
    torch.testing.assert_close(kw.sum(-1), torch.full_like(kw.sum(-1), float(out.shape[1] - 1)), rtol=1e-3, atol=0)
    assert torch.isfinite(t[0].lse).all()
