"""Rows a query may not read: zero context, zero weights, finite and correct gradients on every path."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from headwise import AttentionConfig, AttentionHead, KVCache, MaterializationWarning, MultiHeadAttention
from headwise import RotaryEmbedding
from headwise import functional as hwf
from headwise import masks as hwm
from tests.reference import reference_heads, reference_mha

_PLAN_FORWARD = MultiHeadAttention.forward.__globals__["plan_forward"]
PLAN = _PLAN_FORWARD.__globals__["plan_attention"].__globals__



def _grads(attn: MultiHeadAttention, x: torch.Tensor, **kw) -> dict[str, torch.Tensor]:
    attn.zero_grad()
    x = x.detach().requires_grad_()
    out = attn(x, **kw)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    return {"x": x.grad, **{n: p.grad.clone() for n, p in attn.named_parameters()}}



def _blocked_row_masks():
    row = torch.zeros(3, 3, dtype=torch.float64)
    row[0] = float("-inf")
    keep = torch.tensor([[False, True, True], [False, False, False]])  # left padding; sequence 1 is all padding
    bias = torch.randn(3, 3, dtype=torch.float64)
    combined = hwm.combine_masks(hwm.padding_mask(keep=keep), bias, hwm.causal_mask(3))
    return {"row": row, "padding+bias+causal": combined}


@pytest.mark.parametrize("mask_name", ["row", "padding+bias+causal"])
@pytest.mark.parametrize("path", ["eager", "weights", "heads"])
def test_blocked_rows_give_finite_gradients_equal_to_the_fused_kernels(mask_name, path):
    mask = _blocked_row_masks()[mask_name]
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, backend="eager" if path == "eager" else "sdpa").double()
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    if path == "heads":
        def layer(inp, **kw):
            return sum(attn.head(i)(inp, **kw) @ attn.head(i).w_o for i in range(4)) + attn.out_proj.bias
        attn.zero_grad()
        xg = x.clone().requires_grad_()
        layer(xg, mask=mask).sum().backward()
        got = {"x": xg.grad, **{n: p.grad.clone() for n, p in attn.named_parameters()}}
    else:
        got = _grads(attn, x, mask=mask, return_weights=path == "weights")
    attn.backend = "sdpa"
    want = _grads(attn, x, mask=mask)  # PyTorch's fused kernel: the peer
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        torch.testing.assert_close(got[name], want[name])




def _padding_rows_mask(dtype: torch.dtype) -> torch.Tensor:
    """Hugging Face's padding convention: blocked entries at the dtype's minimum, one query row entirely."""
    m = torch.zeros(2, 1, 4, 4, dtype=dtype)
    m[:, :, 0, 2:] = torch.finfo(dtype).min
    m[1, :, 3, :] = torch.finfo(dtype).min  # a padded query of the second sample reads nothing
    return m


def test_rows_at_the_dtype_minimum_get_the_formulas_gradient():
    # PyTorch's fused CPU backward is wrong on a row entirely at finfo.min (dq off by a factor of up to 4);
    # headwise runs such calls on the eager path while autograd records.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 4, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = _padding_rows_mask(torch.float64)
    z, _ = hwf.attention(q, k, v, mask=mask)
    ref, _ = reference_heads(q, k, v, mask=mask)
    torch.testing.assert_close(z, ref)
    grads = torch.autograd.grad(z.pow(2).sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


def test_rows_whose_readable_keys_are_all_at_the_minimum_under_causal_get_the_formulas_gradient():
    # Left padding given as an additive finfo.min key mask plus causal=True: the first queries may read only
    # padded keys (the causal mask blocks the rest), rows at the minimum as the kernel sees them.
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.zeros(2, 1, 1, 5, dtype=torch.float64)
    mask[1, ..., :2] = torch.finfo(torch.float64).min  # sample 1: keys 0 and 1 are padding
    z, _ = hwf.attention(q, k, v, mask=mask, causal=True)
    ref, _ = reference_heads(q, k, v, mask=mask, causal=True)
    torch.testing.assert_close(z, ref)
    grads = torch.autograd.grad(z.pow(2).sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)
    # the layer, causal and as a cached prefill (causal by the cache), against the layer's eager path
    attn = MultiHeadAttention(16, 2, dtype=torch.float64)
    eager = MultiHeadAttention(16, 2, dtype=torch.float64, backend="eager")
    eager.load_state_dict(attn.state_dict())
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    want = _grads(eager, x, mask=mask, causal=True)
    for got in (_grads(attn, x, mask=mask, causal=True), _grads(attn, x, mask=mask, cache=attn.new_cache(2, 8))):
        for name in want:
            torch.testing.assert_close(got[name], want[name])
    assert "fused backward is wrong" in " ".join(attn.explain_dispatch(x.requires_grad_(), mask=mask,
                                                                       causal=True).reasons)


def test_the_layer_routes_minimum_rows_to_a_correct_gradient_and_keeps_the_fused_forward():
    attn = MultiHeadAttention(16, 2, dtype=torch.float64)
    eager = MultiHeadAttention(16, 2, dtype=torch.float64, backend="eager")
    eager.load_state_dict(attn.state_dict())
    x = torch.randn(2, 4, 16, dtype=torch.float64)
    mask = _padding_rows_mask(torch.float64)
    got, want = _grads(attn, x, mask=mask), _grads(eager, x, mask=mask)
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    with torch.no_grad():  # no autograd: nothing to route, the fused kernel's forward is right
        assert attn.explain_dispatch(x, mask=mask).backend == "sdpa"
        torch.testing.assert_close(attn(x, mask=mask), eager(x, mask=mask))


def test_a_trainable_layer_with_a_floating_mask_compiles_whole_with_the_formulas_gradient():
    # Compiled code cannot read the mask to look for minimum rows: while autograd records, a floating mask takes
    # the eager path there, whatever its rows.
    import torch._dynamo.testing

    torch._dynamo.reset()  # frames compiled by earlier tests in this worker would count here
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2, dtype=torch.float64)
    eager = MultiHeadAttention(16, 2, dtype=torch.float64, backend="eager")
    eager.load_state_dict(attn.state_dict())
    x = torch.randn(2, 4, 16, dtype=torch.float64, requires_grad=True)
    mask = _padding_rows_mask(torch.float64)
    for m in (mask, torch.zeros_like(mask)):
        counter = torch._dynamo.testing.CompileCounter()
        compiled = torch.compile(attn, backend=counter, fullgraph=True)  # a data-dependent read would raise
        out = compiled(x, mask=m)
        assert counter.frame_count == 1
        torch.testing.assert_close(out, reference_mha(attn, x.detach(), mask=m)[0])
        got = torch.autograd.grad(out.sum(), (x, *attn.parameters()))
        want = torch.autograd.grad(eager(x, mask=m).sum(), (x, *eager.parameters()))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
