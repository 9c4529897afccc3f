"""The one float64 reference for multi-head attention, written from the formula head by head.

It shares no code with headwise: per head h, with the head's own slices of the packed weights,
    Q_h = x W_Q^h + b_Q^h,  K_h = c W_K^g + b_K^g,  V_h = c W_V^g + b_V^g   (g = h // (n_heads / n_kv_heads))
    S_h = cap(Q_h K_h^T * scale) + mask,   cap(s) = softcap * tanh(s / softcap)   (when a softcap is given)
    A_h = softmax over the allowed keys of S_h (plus one sink logit per head, dropped afterwards)
    Z_h = A_h V_h,   y = concat_h(Z_h) W_O + b_O
Masked positions (False, or -inf added) are excluded from the softmax; a row with no allowed position gives
zero weights and a zero context.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width, d_h: head width, d_v: value width.
"""

from __future__ import annotations

import math

import torch


def rope64(t: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
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


def allowed_and_additive(b: int, h: int, s_q: int, s_kv: int, mask: torch.Tensor | None, causal: bool):
    """Boolean "may attend" and float64 additive terms, both (b, h, s_q, s_kv). Causal is bottom-right:
    query i sits at absolute position s_kv - s_q + i."""
    allowed = torch.ones(b, h, s_q, s_kv, dtype=torch.bool)
    add = torch.zeros(b, h, s_q, s_kv, dtype=torch.float64)
    if causal:
        i = torch.arange(s_q)[:, None]
        j = torch.arange(s_kv)[None, :]
        allowed &= j <= i + (s_kv - s_q)
    if mask is not None:
        m = torch.broadcast_to(mask, (b, h, s_q, s_kv))
        if m.dtype == torch.bool:
            allowed &= m
        else:
            m = m.double()
            allowed &= m != -math.inf
            add = add + torch.where(m == -math.inf, torch.zeros_like(m), m)
    return allowed, add


def reference_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
                    causal: bool = False, scale: float | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None):
    """Attention on split heads, float64, one head at a time.

    Shapes: q (b, h, s_q, d_h); k (b, h_kv, s_kv, d_h); v (b, h_kv, s_kv, d_v); sinks (h,) or 4-D broadcastable
        to (b, h, s_q, 1)
        -> context (b, h, s_q, d_v), weights (b, h, s_q, s_kv)
    """
    q, k, v = q.double(), k.double(), v.double()
    b, h, s_q, d_h = q.shape
    h_kv, s_kv = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d_h) if scale is None else scale
    allowed, add = allowed_and_additive(b, h, s_q, s_kv, mask, causal)
    if sinks is not None:  # one logit per query row: (b, h, s_q, 1)
        sinks = (sinks.view(1, h, 1, 1) if sinks.dim() == 1 else sinks).double().expand(b, h, s_q, 1)
    contexts, weights = [], []
    for head in range(h):
        g = head // (h // h_kv)
        scores = q[:, head] @ k[:, g].transpose(-1, -2) * scale  # (b, s_q, s_kv)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores + add[:, head]
        ok = allowed[:, head]
        scores = scores.masked_fill(~ok, -math.inf)
        if sinks is not None:  # one more logit that carries no value
            scores = torch.cat([scores, sinks[:, head]], dim=-1)
            ok = torch.cat([ok, torch.ones(b, s_q, 1, dtype=torch.bool)], dim=-1)
        any_ok = ok.any(-1, keepdim=True)
        top = (torch.where(any_ok, scores.amax(-1, keepdim=True), torch.zeros_like(scores[..., :1]))
               if scores.shape[-1] else torch.zeros(b, s_q, 1, dtype=torch.float64))
        e = torch.exp(scores - top).masked_fill(~ok, 0.0)
        a = torch.where(any_ok, e / e.sum(-1, keepdim=True).clamp_min(1e-300), torch.zeros_like(e))[..., :s_kv]
        contexts.append(a @ v[:, g])
        weights.append(a)
    return torch.stack(contexts, 1), torch.stack(weights, 1)


def reference_mha(attn, x: torch.Tensor, context: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
                  causal: bool = False, positions: torch.Tensor | None = None,
                  key: torch.Tensor | None = None, value: torch.Tensor | None = None):
    """float64 output (b, s_q, d) and weights (b, h, s_q, s_kv) of ``attn`` (a MultiHeadAttention) on x.

    ``reference_mha.peak`` is afterwards the largest |q|, |k|, |v| or |y| it met (for tolerance scaling)."""
    cfg = attn.config
    x = x.double()
    kin = (key if key is not None else context if context is not None else x).double()
    vin = (value if value is not None else context if context is not None else x).double()
    b, s_q, _ = x.shape
    h, h_kv, d_h = cfg.n_heads, cfg.n_kv_heads, cfg.d_head

    def w(lin):
        return lin.weight.detach().double(), None if lin.bias is None else lin.bias.detach().double()

    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = w(attn.q_proj), w(attn.k_proj), w(attn.v_proj), w(attn.out_proj)
    qs, ks, vs = [], [], []
    for head in range(h):
        sq = slice(head * d_h, (head + 1) * d_h)
        q = x @ wq[sq].T + (0 if bq is None else bq[sq])
        if attn.rotary is not None:
            q = rope64(q, torch.arange(s_q) if positions is None else positions, attn.rotary.inv_freq)
        qs.append(q)
    for g in range(h_kv):
        sk = slice(g * d_h, (g + 1) * d_h)
        k = kin @ wk[sk].T + (0 if bk is None else bk[sk])
        if attn.rotary is not None:
            k = rope64(k, torch.arange(s_q) if positions is None else positions, attn.rotary.inv_freq)
        ks.append(k)
        vs.append(vin @ wv[sk].T + (0 if bv is None else bv[sk]))
    q, k, v = torch.stack(qs, 1), torch.stack(ks, 1), torch.stack(vs, 1)
    z, a = reference_heads(q, k, v, mask=mask, causal=causal, scale=cfg.scale)
    y = z.transpose(1, 2).reshape(b, s_q, h * d_h) @ wo.T + (0 if bo is None else bo)
    reference_mha.peak = max([0.0] + [float(t.abs().max()) for t in (q, k, v, y) if t.numel()])
    return y, a


def head_reference(w_q, w_k, w_v, x, *, scale=None):
    """One head alone, float64: softmax(x w_q (x w_k)^T * scale) x w_v."""
    x = x.double()
    q, k, v = x @ w_q.double(), x @ w_k.double(), x @ w_v.double()
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.softmax(q @ k.transpose(-2, -1) * scale, -1) @ v
