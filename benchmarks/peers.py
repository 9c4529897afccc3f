"""The layers headwise is measured against, each built from a headwise layer's weights so that every peer
computes the same function on the same inputs (each group checks that on its warm-up call).

* :class:`PackedSDPA`: the practical limit, one fused QKV projection, a view/transpose, PyTorch's fused
  ``scaled_dot_product_attention``, the merge and the output projection, nothing else.
* :func:`mha_peer`: ``nn.MultiheadAttention`` holding the same weights (its CPU fast path in eval/no_grad).
* :class:`XWDecoder`: the fastest honest decode loop, ``x @ W`` with a preallocated cache.
* :class:`LinearDecoder`: the same loop over the layer's own ``nn.Linear`` weights (``F.linear``): where the
  decode gap to ``x @ W`` comes from the weights' layout, not from the code around the kernels.

Shapes:
    b: batch, s: sequence, d: d_model, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from headwise import MultiHeadAttention

__all__ = ["PackedSDPA", "mha_peer", "XWDecoder", "LinearDecoder"]


def _qkv_weight(attn: MultiHeadAttention) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W_Q, W_K, W_V stacked as one (out, in) matrix, and their biases (None without)."""
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    w = torch.cat([p.weight.detach() for p in projs])
    b = None if attn.q_proj.bias is None else torch.cat([p.bias.detach() for p in projs])
    return w, b


class PackedSDPA(nn.Module):
    """Minimal packed attention: the fastest a fused-SDPA layer can be written in PyTorch.

    ``repeat_kv=True`` expands K/V to every query head before SDPA (the classic GQA implementation).

    Shapes:
        x: (b, s, d) -> (b, s, d)
    """

    def __init__(self, attn: MultiHeadAttention, *, repeat_kv: bool = False) -> None:
        super().__init__()
        cfg = attn.config
        self.h, self.h_kv, self.d_h, self.repeat_kv = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, repeat_kv
        w, b = _qkv_weight(attn)
        kw = dict(device=w.device, dtype=w.dtype)
        self.qkv = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, **kw)
        self.out = nn.Linear(attn.out_proj.in_features, attn.out_proj.out_features,
                             bias=attn.out_proj.bias is not None, **kw)
        with torch.no_grad():
            self.qkv.weight.copy_(w)
            self.out.weight.copy_(attn.out_proj.weight)
            if b is not None:
                self.qkv.bias.copy_(b)
            if attn.out_proj.bias is not None:
                self.out.bias.copy_(attn.out_proj.bias)

    def forward(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.d_h, self.h_kv * self.d_h, self.h_kv * self.d_h], dim=-1)
        q = q.view(b, s, self.h, self.d_h).transpose(1, 2)  # (b, h, s, d_h)
        k = k.view(b, s, self.h_kv, self.d_h).transpose(1, 2)  # (b, h_kv, s, d_h)
        v = v.view(b, s, self.h_kv, self.d_h).transpose(1, 2)  # (b, h_kv, s, d_h)
        gqa = self.h != self.h_kv
        if gqa and self.repeat_kv:
            k = k.repeat_interleave(self.h // self.h_kv, dim=1)  # (b, h, s, d_h)
            v = v.repeat_interleave(self.h // self.h_kv, dim=1)  # (b, h, s, d_h)
            gqa = False
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return self.out(o.transpose(1, 2).reshape(b, s, self.h * self.d_h))  # (b, s, d)


def mha_peer(attn: MultiHeadAttention) -> nn.MultiheadAttention:
    """``nn.MultiheadAttention`` (batch_first) holding ``attn``'s weights (MHA with biases only)."""
    cfg = attn.config
    w, b = _qkv_weight(attn)
    m = nn.MultiheadAttention(cfg.d_model, cfg.n_heads, bias=b is not None, batch_first=True)
    with torch.no_grad():
        m.in_proj_weight.copy_(w)
        m.out_proj.weight.copy_(attn.out_proj.weight)
        if b is not None:
            m.in_proj_bias.copy_(b)
            m.out_proj.bias.copy_(attn.out_proj.bias)
    return m


class XWDecoder:
    """The minimal preallocated-cache decode loop written with ``x @ W`` weights, as a plain object (no
    ``nn.Module`` call machinery): W_Q, W_K, W_V and W_O stored (d_in, d_out), contiguous; per token one
    ``addmm`` per projection, the new key and value written in place into a preallocated buffer,
    ``F.scaled_dot_product_attention`` over the filled prefix, the merge (a view: one token) and ``@ W_O``.

    ``attn``'s weights are copied, never shared; ``attn`` must have no rotary embedding. One token per call.
    ``kernels`` restricts SDPA to those backends (``torch.nn.attention.SDPBackend`` members; None: PyTorch's
    choice), as a user who knows about cuDNN's per-shape plans on CUDA would.

    Shapes:
        x: (b, 1, d) -> (b, 1, d); buffers: (b, h_kv, max_len, d_h)
    """

    def __init__(self, attn: MultiHeadAttention, batch_size: int, max_len: int, *, kernels: list | None = None) -> None:
        if getattr(attn, "rotary", None) is not None:
            raise ValueError("XWDecoder computes no rotary embedding; expected a layer with rotary=None, "
                             f"got {type(attn.rotary).__name__}")
        cfg = attn.config
        self.h, self.h_kv, self.d_h, self.scale = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.scale
        projs = (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj)
        self.w = [p.weight.detach().t().contiguous() for p in projs]  # (d_in, d_out) each
        self.b = [None if p.bias is None else p.bias.detach().clone() for p in projs]
        self.keys = torch.zeros(batch_size, self.h_kv, max_len, self.d_h, dtype=self.w[0].dtype,
                                device=self.w[0].device)
        self.kernels = kernels
        self.values = torch.zeros_like(self.keys)
        self.length = 0

    def fill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Start from cached keys and values ``k``, ``v`` (b, h_kv, n, d_h)."""
        n = k.shape[2]
        self.keys[:, :, :n].copy_(k)
        self.values[:, :, :n].copy_(v)
        self.length = n

    def _proj(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w[i] if self.b[i] is None else torch.addmm(self.b[i], x, self.w[i])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        x2 = x.view(b, d)  # one token: (b, d)
        q, k, v = self._proj(0, x2), self._proj(1, x2), self._proj(2, x2)  # (b, h * d_h), (b, h_kv * d_h) x 2
        n = self.length
        self.keys[:, :, n].copy_(k.view(b, self.h_kv, self.d_h))  # slot n of (b, h_kv, max_len, d_h)
        self.values[:, :, n].copy_(v.view(b, self.h_kv, self.d_h))
        self.length = n + 1
        attend = partial(F.scaled_dot_product_attention, q.view(b, self.h, 1, self.d_h), self.keys[:, :, :n + 1],
                         self.values[:, :, :n + 1], scale=self.scale, enable_gqa=self.h != self.h_kv)
        if self.kernels is None:
            o = attend()  # (b, h, 1, d_h)
        else:
            with sdpa_kernel(self.kernels):
                o = attend()
        return self._proj(3, o.reshape(b, self.h * self.d_h)).view(b, 1, d)


class LinearDecoder(XWDecoder):
    """:class:`XWDecoder` with ``F.linear`` over ``attn``'s own weight tensors, stored ``(d_out, d_in)`` as
    ``nn.Linear`` keeps them (shared, not copied): the loop a headwise layer's kernels amount to. Its ratio to
    the ``x @ W`` loop is what the weights' layout costs on the machine; it is reported, not a goal's peer."""

    def __init__(self, attn: MultiHeadAttention, batch_size: int, max_len: int, *, kernels: list | None = None) -> None:
        super().__init__(attn, batch_size, max_len, kernels=kernels)
        projs = (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj)
        self.w = [p.weight.detach() for p in projs]  # (d_out, d_in) each: the layer's own tensors
        self.b = [None if p.bias is None else p.bias.detach() for p in projs]

    def _proj(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w[i], self.b[i])
