"""Empty inputs (batch 0, s_q = 0, s_kv = 0) stay in the autograd graph: the input, the context and every
weight get the gradient PyTorch's own layers give (empty, or zeros of the right shape), never None.

References: ``nn.MultiheadAttention`` for the layer (MHA), a plain module of ``nn.Linear`` and
``F.scaled_dot_product_attention`` holding the same weights for GQA and cross-attention, and SDPA itself
for ``functional.attention``.

Shapes:
    x: (b, s_q, d); context: (b, s_kv, d); q: (b, h, s_q, d_h); k, v: (b, h_kv, s_kv, d_h).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from headwise import MultiHeadAttention
from headwise.functional import attention

_SHAPES = [(0, 5), (2, 0), (0, 0)]  # (b, s)


class _PlainSdpa(nn.Module):
    """The layer's weights around one SDPA call: the gradients torch gives this layer's math."""

    def __init__(self, attn: MultiHeadAttention) -> None:
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self, name, copy.deepcopy(getattr(attn, name)))
        self.h, self.h_kv, self.d_h, self.scale = attn.n_heads, attn.n_kv_heads, attn.d_head, attn.config.scale

    def forward(self, x: torch.Tensor, context: torch.Tensor, causal: bool) -> torch.Tensor:
        b, s_q, s_kv = x.shape[0], x.shape[1], context.shape[1]
        q = self.q_proj(x).view(b, s_q, self.h, self.d_h).transpose(1, 2)  # (b, h, s_q, d_h)
        k = self.k_proj(context).view(b, s_kv, self.h_kv, self.d_h).transpose(1, 2)  # (b, h_kv, s_kv, d_h)
        v = self.v_proj(context).view(b, s_kv, self.h_kv, self.d_h).transpose(1, 2)  # (b, h_kv, s_kv, d_h)
        z = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.scale, enable_gqa=True)
        return self.out_proj(z.transpose(1, 2).reshape(b, s_q, self.h * self.d_h))  # (b, s_q, d)


def _grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in module.named_parameters()}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b, s", _SHAPES)
def test_the_layer_gives_an_empty_input_the_gradients_of_torch_multihead_attention(b, s, causal):
    torch.manual_seed(0)
    attn = MultiHeadAttention(64, 8)
    ref = nn.MultiheadAttention(64, 8, batch_first=True)
    x, x_ref = torch.randn(b, s, 64, requires_grad=True), torch.randn(b, s, 64, requires_grad=True)
    attn(x, causal=causal).sum().backward()
    mask = nn.Transformer.generate_square_subsequent_mask(s) if causal else None
    ref(x_ref, x_ref, x_ref, attn_mask=mask, is_causal=causal, need_weights=False)[0].sum().backward()
    assert x.grad is not None and x_ref.grad is not None
    torch.testing.assert_close(x.grad, x_ref.grad)
    q_w, k_w, v_w = ref.in_proj_weight.grad.chunk(3)
    q_b, k_b, v_b = ref.in_proj_bias.grad.chunk(3)
    want = {"q_proj.weight": q_w, "q_proj.bias": q_b, "k_proj.weight": k_w, "k_proj.bias": k_b,
            "v_proj.weight": v_w, "v_proj.bias": v_b, "out_proj.weight": ref.out_proj.weight.grad,
            "out_proj.bias": ref.out_proj.bias.grad}
    got = _grads(attn)
    assert got.keys() == want.keys() and all(g is not None for g in got.values()), got
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


@pytest.mark.parametrize("b, s_q, s_kv", [(0, 5, 5), (2, 0, 0), (0, 0, 0), (2, 3, 0), (2, 0, 4)])
def test_gqa_self_and_cross_attention_on_empty_inputs_match_a_plain_sdpa_module(b, s_q, s_kv):
    """GQA (8 query heads, 2 K/V heads); s_q != s_kv is cross-attention, where s_kv = 0 gives a zero context."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(64, 8, 2)
    ref = _PlainSdpa(attn)
    x, c = torch.randn(b, s_q, 64, requires_grad=True), torch.randn(b, s_kv, 64, requires_grad=True)
    x_ref, c_ref = x.detach().clone().requires_grad_(), c.detach().clone().requires_grad_()
    self_attention = s_q == s_kv
    y = attn(x) if self_attention else attn(x, c)
    y_ref = ref(x_ref, x_ref if self_attention else c_ref, causal=False)
    torch.testing.assert_close(y, y_ref)
    (y * torch.arange(1.0, 65.0)).sum().backward()  # a loss that weighs the widths apart
    (y_ref * torch.arange(1.0, 65.0)).sum().backward()
    pairs = [(x.grad, x_ref.grad)] + ([] if self_attention else [(c.grad, c_ref.grad)])
    for got, want in pairs:
        assert got is not None and want is not None
        torch.testing.assert_close(got, want)
    got, want = _grads(attn), _grads(ref)
    assert all(g is not None for g in got.values()), got
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("b, s_q, s_kv", [(0, 5, 5), (2, 0, 0), (2, 3, 0), (2, 0, 4)])
def test_functional_attention_on_empty_inputs_gives_sdpas_gradients(b, s_q, s_kv, backend):
    torch.manual_seed(0)
    q = torch.randn(b, 8, s_q, 16, requires_grad=True)
    k, v = torch.randn(b, 2, s_kv, 16, requires_grad=True), torch.randn(b, 2, s_kv, 16, requires_grad=True)
    z, weights = attention(q, k, v, backend=backend, return_weights=backend == "eager")
    if weights is not None:
        assert weights.shape == (b, 8, s_q, s_kv)
    refs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    z_ref = F.scaled_dot_product_attention(*refs, enable_gqa=True)
    torch.testing.assert_close(z, z_ref)
    z.sum().backward()
    z_ref.sum().backward()
    for got, want in zip((q, k, v), refs):
        assert got.grad is not None
        torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("b, s_q, s_kv", [(0, 3, 3), (2, 0, 3), (2, 3, 0)])
def test_sinks_of_an_empty_call_get_the_formulas_zero_gradient(b, s_q, s_kv):
    # the formula with the sink column (a logit per head that takes probability and carries no value), written out
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4, 2)
    q = torch.randn(b, 4, s_q, 8, requires_grad=True)
    k, v = (torch.randn(b, 2, s_kv, 8, requires_grad=True) for _ in range(2))
    sinks = torch.zeros(4, requires_grad=True)
    z, _ = attn.attend(q, k, v, sinks=sinks)
    z.sum().backward()
    ref_sinks = torch.zeros(4, requires_grad=True)
    scores = q.detach() @ k.detach().repeat_interleave(2, 1).transpose(-1, -2) / 8 ** 0.5  # (b, h, s_q, s_kv)
    p = torch.cat([scores, ref_sinks.view(1, 4, 1, 1).expand(b, 4, s_q, 1)], -1).softmax(-1)[..., :s_kv]
    (p @ v.detach().repeat_interleave(2, 1)).sum().backward()
    assert sinks.grad is not None
    torch.testing.assert_close(sinks.grad, ref_sinks.grad)
