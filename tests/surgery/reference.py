"""Independent float64 references for surgery tests, written from the formula (no headwise code)."""

from __future__ import annotations

import torch


def weights(attn) -> dict[str, torch.Tensor | None]:
    """The layer's (out, in) weights and biases, float64 copies."""
    out = {}
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        p = getattr(attn, name)
        out[name + ".w"] = p.weight.detach().double().clone()
        out[name + ".b"] = None if p.bias is None else p.bias.detach().double().clone()
    return out


def attention(w: dict, x: torch.Tensor, h: int, h_kv: int, d_h: int, *, gate: torch.Tensor | None = None,
              causal: bool = False) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d_h)) V per head, each head's context times gate[head], then W_O.

    Shapes: x (b, s, d) -> (b, s, d); gate (h,) or None
    """
    def lin(name: str) -> torch.Tensor:
        y = x.double() @ w[name + ".w"].T
        return y if w[name + ".b"] is None else y + w[name + ".b"]

    q, k, v = lin("q_proj"), lin("k_proj"), lin("v_proj")
    g = h // h_kv
    s = x.shape[1]
    heads = []
    for i in range(h):
        qi = q[..., i * d_h:(i + 1) * d_h]
        j = i // g
        kj, vj = k[..., j * d_h:(j + 1) * d_h], v[..., j * d_h:(j + 1) * d_h]
        scores = qi @ kj.transpose(-1, -2) / d_h ** 0.5
        if causal:
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        z = scores.softmax(-1) @ vj
        heads.append(z if gate is None else z * gate[i])
    y = torch.cat(heads, dim=-1) @ w["out_proj.w"].T
    return y if w["out_proj.b"] is None else y + w["out_proj.b"]
