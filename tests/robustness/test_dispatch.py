"""explain_dispatch: one test per rule, a check that it predicts what forward actually runs, and the warnings."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import headwise
from headwise import AttentionConfig, MaterializationWarning, MultiHeadAttention
from headwise import dispatch
from headwise import functional as hwf
from headwise import masks as hwm

# headwise.dispatch as the layer sees it: collecting doctests with --import-mode=importlib can put a second copy
# of the module in sys.modules, so thresholds are patched through the functions' own globals.
DISPATCH = MultiHeadAttention.explain_dispatch.__globals__["explain_forward"].__globals__["describe"].__globals__
_PLAN_FORWARD = MultiHeadAttention.forward.__globals__["plan_forward"]
PLAN = _PLAN_FORWARD.__globals__["plan_attention"].__globals__

D, H, H_KV = 16, 4, 2
KERNELS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}


def make(backend="sdpa", dtype=torch.float32, dropout=0.0):
    torch.manual_seed(0)
    return MultiHeadAttention(D, H, H_KV, backend=backend, dropout=dropout).to(dtype).eval()


def test_default_path_is_fused_and_materializes_nothing():
    info = make().explain_dispatch(torch.randn(2, 5, D))
    assert isinstance(info, headwise.DispatchInfo)
    assert (info.backend, info.causal_via, info.materializes_probabilities, info.probability_bytes) == \
        ("sdpa", "none needed", False, 0)
    assert info.scores_shape == (2, H, 5, 5)
    assert info.kernel in ("flash", "efficient", "cudnn", "fused")


@pytest.mark.skipif(not hasattr(torch, "_fused_sdp_choice"), reason="PyTorch's private selector is absent")
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(mask="padding"), dict(mask="padding", causal=True)])
def test_kernel_matches_pytorchs_selector_on_the_real_tensors(kw):
    attn = make()
    x = torch.randn(2, 5, D)
    mask = hwm.padding_mask(lengths=[5, 3], s_kv=5) if kw.get("mask") else None
    causal = kw.get("causal", False)
    info = attn.explain_dispatch(x, mask=mask, causal=causal)
    q = attn.project_q(x)
    k, v = attn.project_kv(x)
    kernel_mask = hwm.combine_masks(mask, hwm.causal_mask(5)) if causal and mask is not None else mask
    idx = torch._fused_sdp_choice(q, k, v, attn_mask=kernel_mask, is_causal=causal and mask is None,
                                  scale=attn.config.scale, enable_gqa=True)
    assert info.kernel == KERNELS[int(idx)]


@pytest.mark.parametrize("s_q, s_kv, masked, via", [
    (5, 5, False, "kernel is_causal"),
    (5, 5, True, "explicit mask"),
    (3, 5, False, "explicit mask"),
    (1, 5, False, "none needed"),
    (1, 5, True, "none needed"),
])
def test_causal_rule(s_q, s_kv, masked, via):
    attn = make()
    x, ctx = torch.randn(2, s_q, D), torch.randn(2, s_kv, D)
    mask = hwm.padding_mask(lengths=[s_kv, 2], s_kv=s_kv) if masked else None
    info = attn.explain_dispatch(x, context=None if s_q == s_kv else ctx, mask=mask, causal=True)
    assert info.causal_via == via
    assert any("causal" in r for r in info.reasons)


def test_return_weights_takes_the_eager_path_and_counts_bytes():
    info = make().explain_dispatch(torch.randn(3, 7, D), causal=True, return_weights=True)
    assert (info.backend, info.kernel, info.materializes_probabilities, info.causal_via) == \
        ("eager", "eager", True, "explicit mask")
    assert info.probability_bytes == 3 * H * 7 * 7 * 4
    assert any("return_weights=True" in r for r in info.reasons)


def test_eager_backend_counts_half_precision_as_float32():
    info = make("eager", dtype=torch.bfloat16).explain_dispatch(torch.randn(2, 5, D, dtype=torch.bfloat16))
    assert info.backend == "eager" and info.probability_bytes == 2 * H * 5 * 5 * 4
    assert any("backend='eager'" in r for r in info.reasons)


def test_dropout_in_training_uses_the_math_kernel_on_cpu():
    attn = make(dropout=0.1).train()
    info = attn.explain_dispatch(torch.randn(2, 5, D))
    assert (info.kernel, info.materializes_probabilities, info.probability_bytes) == ("math", True, 2 * H * 25 * 4)
    assert attn.eval().explain_dispatch(torch.randn(2, 5, D)).kernel == "flash"


def softmax_bytes(run) -> int:
    """Bytes PyTorch's CPU allocator gives the largest softmax while ``run()`` executes."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return max(e.cpu_memory_usage for e in prof.events() if e.name == "aten::_softmax")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduce_in_half", [False, True])
def test_math_kernel_bytes_are_what_pytorch_allocates(dtype, reduce_in_half):
    attn = make(dropout=0.1, dtype=dtype).train()
    x = torch.randn(1, 64, D, dtype=dtype)
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(reduce_in_half)
    try:
        info = attn.explain_dispatch(x)
        allocated = softmax_bytes(lambda: attn(x))
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)
    assert info.kernel == "math" and info.probability_bytes == allocated


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_statistics_chunks_are_the_ones_stated(monkeypatch, dtype):
    b, h, s = 1, 12, 1024
    attn = MultiHeadAttention(96, h, dtype=dtype).eval()
    x = torch.randn(b, s, 96, dtype=dtype)
    with torch.no_grad():
        info = attn.explain_dispatch(x, statistics=("entropy",))
    stated = [r for r in info.reasons if "query rows at a time" in r]
    rows = []
    real_exp = torch.exp

    def spy_exp(t, *a, **k):  # each chunk exponentiates its (b, h, rows, s_kv) scores once
        if t.dim() == 4 and t.shape[-1] == s:
            rows.append(t.shape[2])
        return real_exp(t, *a, **k)

    monkeypatch.setattr(torch, "exp", spy_exp)
    with torch.no_grad(), headwise.trace(attn, capture=("entropy",)):
        attn(x)
    assert len(rows) > 1 and len(stated) == 1
    assert f" {max(rows)} query rows at a time ({b}*{h}*{max(rows)}*{s} scores" in stated[0]


def test_cache_forces_causal_and_counts_cached_positions():
    attn = make()
    cache = attn.new_cache(2, 8)
    prefill = attn.explain_dispatch(torch.randn(2, 4, D), cache=cache)
    assert prefill.causal_via == "kernel is_causal" and prefill.scores_shape == (2, H, 4, 4)
    assert any("forces causal=True" in r for r in prefill.reasons)
    attn(torch.randn(2, 4, D), cache=cache)
    step = attn.explain_dispatch(torch.randn(2, 1, D), cache=cache)
    assert step.causal_via == "none needed" and step.scores_shape == (2, H, 1, 5)
    chunk = attn.explain_dispatch(torch.randn(2, 2, D), cache=cache)
    assert chunk.causal_via == "explicit mask" and chunk.scores_shape == (2, H, 2, 6)
    assert cache.length == 4  # explaining never writes


@pytest.mark.parametrize("shape, ctx", [((0, 3, D), None), ((2, 0, D), None), ((2, 3, D), (2, 0, D))])
def test_empty_inputs_run_no_kernel(shape, ctx):
    info = make().explain_dispatch(torch.randn(shape), context=None if ctx is None else torch.randn(ctx),
                                   return_weights=True)
    assert (info.backend, info.kernel, info.materializes_probabilities) == ("empty", "none", False)


def test_unbatched_input():
    assert make().explain_dispatch(torch.randn(5, D)).scores_shape == (1, H, 5, 5)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(mask=True), dict(mask=True, causal=True),
                                dict(return_weights=True), dict(cross=True, causal=True), dict(decode=True),
                                dict(key_value=True), dict(key_value=True, causal=True),
                                dict(key_value=True, mask=True), dict(key_value=True, return_weights=True)])
def test_explanation_predicts_what_forward_runs(monkeypatch, kw):
    """Spy on the kernels forward calls: backend, is_causal and the presence of a mask must match."""
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def spy_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **rest):
        calls.append(("sdpa", is_causal, attn_mask is not None))
        return real_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **rest)

    real_softmax = torch.softmax

    def spy_eager(*a, **k):  # only the eager path computes a softmax of its own
        calls.append(("eager", False, True))
        return real_softmax(*a, **k)

    monkeypatch.setattr(hwf.F, "scaled_dot_product_attention", spy_sdpa)
    monkeypatch.setattr(torch, "softmax", spy_eager)
    attn = make()
    x = torch.randn(2, 4, D)
    ctx = torch.randn(2, 6, D) if kw.get("cross") else None
    key = value = None
    if kw.get("key_value"):  # kdim != vdim: only key=/value= can describe such a layer's cross-attention
        torch.manual_seed(0)
        attn = MultiHeadAttention.from_config(AttentionConfig(d_model=D, n_heads=H, kdim=8, vdim=12)).eval()
        key, value = torch.randn(2, 6, 8), torch.randn(2, 6, 12)
    s_kv = 6 if ctx is not None or key is not None else 4
    mask = hwm.padding_mask(lengths=[s_kv, 2], s_kv=s_kv) if kw.get("mask") else None
    cache = None
    if kw.get("decode"):
        cache = attn.new_cache(2, 8)
        attn(x, cache=cache)
        x = torch.randn(2, 1, D)
        calls.clear()
    args = dict(context=ctx, mask=mask, causal=kw.get("causal", False), cache=cache,
                return_weights=kw.get("return_weights", False))
    info = attn.explain_dispatch(x, key=key, value=value, **args)
    attn(x, ctx, key=key, value=value, mask=mask, causal=args["causal"], cache=cache,
         return_weights=args["return_weights"])
    assert len(calls) == 1
    backend, is_causal, has_mask = calls[0]
    assert backend == info.backend
    if key is not None:
        assert info.scores_shape == (2, H, 4, 6)
    if backend == "sdpa":
        assert is_causal == (info.causal_via == "kernel is_causal")
        assert has_mask == (mask is not None or info.causal_via == "explicit mask")


def test_explain_refuses_key_value_as_forward_does():
    attn = MultiHeadAttention.from_config(AttentionConfig(d_model=D, n_heads=H, kdim=8, vdim=12))
    x, k, v = torch.randn(2, 4, D), torch.randn(2, 6, 8), torch.randn(2, 6, 12)
    for kw, message in [(dict(key=k), "pass both key= and value="), (dict(context=k, key=k, value=v), "not both"),
                        (dict(key=k, value=torch.randn(2, 6, 8)), "vdim"), (dict(context=k), "kdim=8 != vdim=12")]:
        for call in (attn, attn.explain_dispatch):
            with pytest.raises(ValueError, match=message):
                call(x, **kw)


# ---- warnings -------------------------------------------------------------------------------------------
def test_explain_warns_above_its_threshold_for_materializing_paths():
    attn = make()
    x = torch.randn(2, 6, D)
    with pytest.warns(MaterializationWarning, match=r"materialise 1152 bytes of attention probabilities "
                                                    r"\(b\*h\*s_q\*s_kv = 2\*4\*6\*6\), above 1000"):
        attn.explain_dispatch(x, return_weights=True, warn_bytes=1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attn.explain_dispatch(x, return_weights=True, warn_bytes=1152)  # at the threshold: silent
        attn.explain_dispatch(x, warn_bytes=0)  # the fused path materialises nothing: never warns


def test_explain_default_threshold(monkeypatch):
    monkeypatch.setitem(DISPATCH, "WARN_BYTES", 100)
    with pytest.warns(MaterializationWarning):
        make().explain_dispatch(torch.randn(1, 4, D), return_weights=True)


def test_forward_warns_only_on_the_eager_path_above_its_threshold(monkeypatch):
    monkeypatch.setitem(PLAN, "FORWARD_WARN_BYTES", 1000)
    x = torch.randn(2, 6, D)  # 2*4*6*6*4 = 1152 bytes of probabilities
    with pytest.warns(MaterializationWarning, match="the eager path materialises b\\*h\\*s_q\\*s_kv = 2\\*4\\*6\\*6"):
        make()(x, return_weights=True)
    with pytest.warns(MaterializationWarning):
        make("eager")(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make()(x)  # default fused path: never warns
        make().train()(x)
        make()(torch.randn(2, 5, D), return_weights=True)  # 800 bytes: under the threshold
    monkeypatch.setitem(PLAN, "FORWARD_WARN_BYTES", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make()(x, causal=True)


def test_default_thresholds_are_large():
    assert dispatch.WARN_BYTES == 256 * 2**20 and headwise.plan.FORWARD_WARN_BYTES == 2**30
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make()(torch.randn(2, 64, D), return_weights=True)
