"""An independent float64 reference for multi-head attention, written from the formula head by head.

It shares no code with headwise.functional: per head h, with the head's own slices of the packed weights,
    Q_h = x W_Q^h + b_Q^h,  K_h = c W_K^g + b_K^g,  V_h = c W_V^g + b_V^g   (g = h // (n_heads / n_kv_heads))
    A_h = softmax(Q_h K_h^T * scale + mask),  Z_h = A_h V_h
    y   = concat_h(Z_h) W_O + b_O
Masked positions are excluded from the softmax; a row with no allowed position gives zero weights.
"""

from __future__ import annotations

import math

import torch


def _rope64(t: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate feature pairs (i, i + r/2) of t (b, s, d_h) by angle pos * inv_freq[i] (explicit formula)."""
    r = 2 * inv_freq.numel()
    half = r // 2
    pos = positions.double().reshape(-1, t.shape[1], 1) if positions.dim() == 2 else positions.double()[None, :, None]
    ang = pos * inv_freq.double()[None, None, :]  # (b or 1, s, r/2)
    x1, x2 = t[..., :half], t[..., half:r]
    out = t.clone()
    out[..., :half] = x1 * torch.cos(ang) - x2 * torch.sin(ang)
    out[..., half:r] = x2 * torch.cos(ang) + x1 * torch.sin(ang)
    return out


def allowed_matrix(b: int, h: int, s_q: int, s_kv: int, mask: torch.Tensor | None, causal: bool):
    """Returns (allowed bool (b, h, s_q, s_kv), additive float64 (b, h, s_q, s_kv))."""
    allowed = torch.ones(b, h, s_q, s_kv, dtype=torch.bool)
    add = torch.zeros(b, h, s_q, s_kv, dtype=torch.float64)
    if causal:
        for i in range(s_q):
            for j in range(s_kv):
                if j > i + (s_kv - s_q):
                    allowed[:, :, i, j] = False
    if mask is not None:
        m = mask.expand(b, h, s_q, s_kv) if mask.dim() == 4 else mask.expand(b, h, s_q, s_kv)
        if m.dtype == torch.bool:
            allowed &= m
        else:
            m = m.double()
            allowed &= m != float("-inf")
            add = torch.where(m == float("-inf"), torch.zeros_like(add), m)
    return allowed, add


def reference_mha(attn, x: torch.Tensor, context: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
                  causal: bool = False, positions: torch.Tensor | None = None,
                  key: torch.Tensor | None = None, value: torch.Tensor | None = None):
    """float64 output (b, s_q, d) and weights (b, h, s_q, s_kv) of ``attn`` (a MultiHeadAttention) on x."""
    cfg = attn.config
    x = x.double()
    kin = (key if key is not None else context if context is not None else x).double()
    vin = (value if value is not None else context if context is not None else x).double()
    b, s_q, _ = x.shape
    s_kv = kin.shape[1]
    h, h_kv, d_h = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    group = h // h_kv
    scale = cfg.scale

    def w(lin):
        return lin.weight.detach().double(), None if lin.bias is None else lin.bias.detach().double()

    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = w(attn.q_proj), w(attn.k_proj), w(attn.v_proj), w(attn.out_proj)
    allowed, add = allowed_matrix(b, h, s_q, s_kv, mask, causal)
    contexts, weights = [], []
    for head in range(h):
        g = head // group
        sq, sk = slice(head * d_h, (head + 1) * d_h), slice(g * d_h, (g + 1) * d_h)
        q = x @ wq[sq].T + (0 if bq is None else bq[sq])
        k = kin @ wk[sk].T + (0 if bk is None else bk[sk])
        v = vin @ wv[sk].T + (0 if bv is None else bv[sk])
        if attn.rotary is not None:
            pos = torch.arange(s_q) if positions is None else positions
            q = _rope64(q, pos, attn.rotary.inv_freq)
            k = _rope64(k, pos, attn.rotary.inv_freq)
        scores = q @ k.transpose(-2, -1) * scale + add[:, head]
        scores = scores.masked_fill(~allowed[:, head], float("-inf"))
        row_max = scores.amax(-1, keepdim=True).clamp(min=-1e300)  # finite even for empty rows
        e = torch.exp(scores - row_max)
        denom = e.sum(-1, keepdim=True)
        a = torch.where(denom > 0, e / denom.clamp(min=1e-300), torch.zeros_like(e))
        contexts.append(a @ v)
        weights.append(a)
    z = torch.cat(contexts, dim=-1)  # (b, s_q, h * d_h), head h's features at h*d_h
    y = z @ wo.T + (0 if bo is None else bo)
    return y, torch.stack(weights, dim=1)


def head_reference(w_q, w_k, w_v, x, *, scale=None):
    """One head alone, float64: softmax(x w_q (x w_k)^T * scale) x w_v."""
    x = x.double()
    q, k, v = x @ w_q.double(), x @ w_k.double(), x @ w_v.double()
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.softmax(q @ k.transpose(-2, -1) * scale, -1) @ v
