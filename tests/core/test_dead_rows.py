"""Rows that may read no key give zeros before W_O on every kernel and dtype: headwise zeros them, not the kernel.

cuDNN (PyTorch's preferred SDPA backend for fp16/bf16 on Hopper) turns a bool mask into a finite -65504 bias,
so a row with no allowed key gets unmasked attention instead of zeros. CI has no GPU, so these tests replace
``F.scaled_dot_product_attention`` with a kernel that behaves that way and check every path against the float64
reference, whose dead rows are zeros by definition.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads, d: model width.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from headwise import MultiHeadAttention
from headwise import functional as hwf
from headwise import masks as hwm
from tests.reference import reference_heads, reference_mha

REAL_SDPA = F.scaled_dot_product_attention
#: (rtol, atol) against float64: see tests/TOLERANCES.md (the bfloat16 layer row, for both half precisions).
TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (5e-2, 5e-2), torch.float16: (5e-2, 5e-2)}


def cudnn_like_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as cuDNN computes a bool mask: a finite bias of -65504 where a key is hidden, so a row that may read
    nothing attends to every key uniformly (in the softmax, a constant bias cancels)."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, -65504.0)
    return REAL_SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa)


@pytest.fixture
def cudnn_like(monkeypatch):
    monkeypatch.setattr(F, "scaled_dot_product_attention", cudnn_like_sdpa)


def padded_mask(b: int, s: int) -> torch.Tensor:
    """Left padding with causal masking: sequence 1 is all padding, sequence 0 has two padded rows."""
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[0, :2] = False
    keep[1] = False
    return hwm.combine_masks(hwm.padding_mask(keep=keep), hwm.causal_mask(s))  # (b, 1, s, s)


def test_the_stand_in_kernel_gives_dead_rows_unmasked_attention_as_cudnn_does():
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    mask = padded_mask(2, 5)
    raw = cudnn_like_sdpa(q, k, v, attn_mask=mask)
    unmasked = REAL_SDPA(q[1:], k[1:], v[1:])  # sequence 1 reads nothing: the kernel attends to every key
    torch.testing.assert_close(raw[1:], unmasked, rtol=1e-2, atol=1e-2)  # scores near -65504 keep 2**-8 steps
    assert raw[1].abs().min() > 0  # so headwise's zeros below are headwise's doing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["bool padding", "float -inf rows", "causal s_q > s_kv"])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_layer_outputs_match_float64_with_dead_rows_on_a_cudnn_like_kernel(cudnn_like, dtype, kind, n_kv_heads):
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4, n_kv_heads).to(dtype)
    x = torch.randn(2, 5, 32, dtype=dtype)
    kw: dict = {}
    if kind == "bool padding":
        kw["mask"] = padded_mask(2, 5)
    elif kind == "float -inf rows":
        bias = torch.randn(2, 1, 5, 5, dtype=dtype)
        bias[0, :, 1] = float("-inf")
        bias[1, :, 3:] = float("-inf")
        kw["mask"] = bias
    else:  # five queries read three keys bottom-right: the first two read nothing
        kw.update(causal=True, context=torch.randn(2, 3, 32, dtype=dtype))
    got = attn(x, **kw)
    ref, _ = reference_mha(attn, x, kw.get("context"), mask=kw.get("mask"), causal=kw.get("causal", False))
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_functional_attention_zeros_dead_rows_before_w_o(cudnn_like, dtype):
    q, k, v = (torch.randn(2, 4, 5, 8, dtype=dtype) for _ in range(3))
    mask = padded_mask(2, 5)
    z, _ = hwf.attention(q, k, v, mask=mask)
    ref, _ = reference_heads(q, k, v, mask=mask)
    assert torch.equal(z[1], torch.zeros_like(z[1])) and torch.equal(z[0, :, :2], torch.zeros_like(z[0, :, :2]))
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(z.double(), ref, rtol=rtol, atol=atol)


def test_a_decode_step_whose_mask_hides_every_key_gives_zeros_under_gqa(cudnn_like):
    attn = MultiHeadAttention(32, 4, 2).eval()
    cache = attn.new_cache(2, 8)
    x = torch.randn(2, 4, 32)
    with torch.no_grad():
        attn(x[:, :3], cache=cache)
        keep = torch.tensor([True, False])[:, None, None, None].expand(2, 1, 1, 4)  # sequence 1 reads nothing
        assert attn.explain_dispatch(x[:, 3:], mask=keep, cache=cache).plan.fold_decode  # the folded GQA route
        got = attn(x[:, 3:], cache=cache, mask=keep)
    torch.testing.assert_close(got[1], attn.out_proj.bias.expand(1, 32))  # zeros before W_O: only its bias
    assert got[0].ne(attn.out_proj.bias).any()


def test_dead_rows_are_zeroed_without_a_graph_break_under_compile(cudnn_like):
    torch._dynamo.reset()
    attn = MultiHeadAttention(32, 4, 2)
    x = torch.randn(2, 5, 32)
    mask = padded_mask(2, 5)
    compiled = torch.compile(attn, backend="aot_eager", fullgraph=True)  # a data-dependent branch would raise
    ref, _ = reference_mha(attn, x, mask=mask)
    torch.testing.assert_close(compiled(x, mask=mask).double(), ref, rtol=1e-4, atol=1e-5)


def test_gradients_through_dead_rows_are_finite_and_match_the_formula(cudnn_like):
    attn = MultiHeadAttention(32, 4, 2).double()
    x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
    mask = padded_mask(2, 5)
    (gx,) = torch.autograd.grad(attn(x, mask=mask).square().sum(), x)
    (rx,) = torch.autograd.grad(reference_mha(attn, x, mask=mask)[0].square().sum(), x)
    torch.testing.assert_close(gx, rx)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_dead_rows_are_found_by_their_definition(kind):
    # A row is dead when every entry is False (bool) or -inf (float); the dtype's minimum is a finite bias.
    torch.manual_seed(0)
    keep = torch.rand(3, 2, 7, 5) > 0.5
    keep[0, 1, 2] = False
    keep[2, 0, 4:] = False
    if kind == "bool":
        mask, want = keep, ~keep.any(-1, keepdim=True)
    else:
        mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
        mask[1, 1, 3] = torch.finfo(torch.float32).min  # finite everywhere: alive
        mask[1, 0, 0, 0] = float("nan")  # never dead, as (mask == -inf).all() says
        want = (mask == float("-inf")).all(-1, keepdim=True)
    opened, dead = hwm.open_dead_rows(mask)
    assert torch.equal(dead, want)
    readable = opened.any(-1) if kind == "bool" else (opened != float("-inf")).any(-1)
    assert opened.dtype == mask.dtype and readable.all()  # every row reads something now
    torch.testing.assert_close(opened[~want.squeeze(-1)], mask[~want.squeeze(-1)], equal_nan=True)


def test_a_mask_without_keys_has_every_row_dead():
    opened, dead = hwm.open_dead_rows(torch.ones(2, 1, 3, 0, dtype=torch.bool))
    assert dead.shape == (2, 1, 3, 1) and dead.all()


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_an_eager_cpu_mask_without_dead_rows_is_returned_as_it_is(dtype):
    # Reading a CPU mask costs no synchronisation, so a mask with no dead row skips the zeroing pass.
    keep = torch.ones(2, 1, 4, 4, dtype=torch.bool).tril()
    mask = keep if dtype == torch.bool else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    opened, dead = hwm.open_dead_rows(mask)
    assert opened is mask and dead is None


def test_vmapped_masks_are_read_with_tensor_operations():
    # Inside torch.func.vmap a mask's data cannot steer Python; each example's answer is still the float64 one.
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 4, 5, 8), torch.randn(3, 1, 2, 5, 8), torch.randn(3, 1, 2, 5, 8)
    masks = torch.ones(3, 1, 1, 5, 5, dtype=torch.bool).tril()
    masks[1, ..., 2, :] = False  # one dead row in example 1 only
    for backend in ("eager", "sdpa"):
        with warnings.catch_warnings():  # vmap runs SDPA's CPU kernel one example at a time, and says so
            warnings.simplefilter("ignore", UserWarning)
            got = torch.func.vmap(lambda q, k, v, m: hwf.attention(q, k, v, mask=m, backend=backend)[0])(q, k, v,
                                                                                                       masks)
        for i in range(3):
            ref, _ = reference_heads(q[i], k[i], v[i], mask=masks[i])
            torch.testing.assert_close(got[i].double(), ref, rtol=1e-5, atol=1e-6)


def test_per_example_gradients_through_a_float_mask():
    # torch.func.grad records autograd, where the plan asks whether a float mask has dead rows; under vmap that
    # question cannot be read off the data, so the layer takes the formula on every row instead of failing.
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, n_kv_heads=2, bias=True)
    x = torch.randn(3, 5, 16)
    masks = torch.zeros(3, 1, 1, 5)
    masks[1, ..., 3:] = torch.finfo(torch.float32).min  # example 1 pads its last two keys, Hugging Face style
    for causal in (False, True):
        got = torch.func.vmap(torch.func.grad(
            lambda xi, mi: attn(xi[None], mask=mi[None], causal=causal).sum()))(x, masks)
        for i in range(3):
            xi = x[i:i + 1].double().requires_grad_()
            ref = torch.autograd.grad(reference_mha(attn, xi, mask=masks[i:i + 1], causal=causal)[0].sum(), xi)[0]
            torch.testing.assert_close(got[i:i + 1].double(), ref, rtol=1e-4, atol=1e-5)
