"""The adapter for ``torch.nn.MultiheadAttention`` (:class:`TorchMHAAdapter`), built on :mod:`.adapters`.

Shapes:
    b: batch, s: tokens, d: d_model, h: heads, d_h: head width.
    run: x (b, s, d) -> (b, s, d); weights (b, h, s, s); contexts (b, h, s, d_h).
"""

from __future__ import annotations

import torch
from torch import nn

from .adapters import Adapter, causal_keep, copy_adapter, split

__all__ = ["TorchMHAAdapter"]


class TorchMHAAdapter(Adapter):
    """``torch.nn.MultiheadAttention`` as self-attention (``m(x, x, x)``), either batch layout.

    Per-head contexts are the module's own output with out_proj swapped for an identity Linear for that one call
    (torch applies W_O inside one fused function, so its input cannot be hooked; inverting W_O would fail for a
    zeroed or ill-conditioned head).

    Shapes:
        x (b, s, d) -> (b, s, d); weights (b, h, s, s) with ``average_attn_weights=False``

    Example:
        >>> ad = TorchMHAAdapter(nn.MultiheadAttention(16, 4))
        >>> ad.run(torch.randn(2, 3, 16)).shape
        torch.Size([2, 3, 16])
    """

    accepts_causal = accepts_mask = exposes_weights = exposes_heads = True

    def __init__(self, module: nn.MultiheadAttention, *, causal: bool = False, name: str | None = None) -> None:
        # each adds keys (or K/V widths) that are not the tokens': the properties' (b, h, s, s) weights would not fit
        extra = [f"{name}={value!r}" for name, value in (
            ("add_bias_kv", module.bias_k is not None), ("add_zero_attn", module.add_zero_attn),
            ("kdim", module.kdim), ("vdim", module.vdim)) if value is True or (
            not isinstance(value, bool) and value != module.embed_dim)]
        if extra:
            raise ValueError("TorchMHAAdapter checks self-attention over the tokens' own keys: nn.MultiheadAttention "
                             f"with add_bias_kv=False, add_zero_attn=False, kdim = vdim = embed_dim "
                             f"({module.embed_dim}), got {', '.join(extra)}")
        self.module = module
        self.name = name or "nn.MultiheadAttention"
        self.d_model = module.embed_dim
        self.claims_causal = causal
        self.n_heads = self.n_kv_heads = module.num_heads
        self.d_head = module.head_dim

    @property
    def dtype(self):
        return self.module.out_proj.weight.dtype

    @property
    def device(self):
        return self.module.out_proj.weight.device

    def _call(self, x, keep, causal, need_weights):
        m = self.module
        causal = self.causal_flag(causal)
        xt = x if m.batch_first else x.transpose(0, 1)
        attn_mask = ~causal_keep(x.shape[1], x.device) if causal else None  # torch: True = blocked
        kpm = None if keep is None else ~keep  # torch: True = ignore
        y, w = m(xt, xt, xt, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=need_weights,
                 average_attn_weights=False)
        return (y if m.batch_first else y.transpose(0, 1)), w

    def run(self, x, *, keep=None, causal=None, positions=None):
        if positions is not None:
            raise ValueError("nn.MultiheadAttention takes no positions")
        return self._call(x, keep, causal, False)[0]

    def run_weights(self, x, *, keep=None, causal=None):
        return self._call(x, keep, causal, True)

    def qk(self, x):
        m, d = self.module, self.d_model
        b = m.in_proj_bias
        q = x @ m.in_proj_weight[:d].T + (0 if b is None else b[:d])
        k = x @ m.in_proj_weight[d:2 * d].T + (0 if b is None else b[d:2 * d])
        return split(q, self.n_heads), split(k, self.n_heads)  # (b, h, s, d_h) each

    def values(self, x):
        m, d = self.module, self.d_model
        b = m.in_proj_bias
        v = x @ m.in_proj_weight[2 * d:].T + (0 if b is None else b[2 * d:])
        return split(v, self.n_heads)  # (b, h, s, d_h)

    def contexts(self, x, *, causal=None):
        # W_O is swapped for an identity Linear for this one call rather than written into: a parametrized
        # out_proj.weight (weight_norm, orthogonal ...) is recomputed on access, and the caller's tensors are
        # never touched
        m = self.module
        out = m.out_proj
        eye = nn.Linear(self.d_model, self.d_model, bias=out.bias is not None, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            eye.weight.copy_(torch.eye(self.d_model, dtype=self.dtype, device=self.device))
            if eye.bias is not None:
                eye.bias.zero_()
        m.out_proj = eye
        try:
            ctx = self.run(x, causal=causal)  # (b, s, h * d_h)
        finally:
            m.out_proj = out
        return split(ctx, self.n_heads)

    def head_slices(self, which, index):
        m, d = self.module, self.d_model
        lo = {"q": 0, "k": d, "v": 2 * d}[which] + index * self.d_head
        out = [(m.in_proj_weight, 0, lo, lo + self.d_head)]
        if m.in_proj_bias is not None:
            out.append((m.in_proj_bias, 0, lo, lo + self.d_head))
        return out

    def converted(self, dtype):
        return copy_adapter(self, dtype)
