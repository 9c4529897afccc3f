"""float64 statistics from a materialised pattern, written from their definitions (shared by tests/trace and
tests/gpu): nothing here comes from headwise.

For every query row, with p its weights on the keys (a sink's share is on no key, so they may sum to less
than 1): entropy = -sum p log p over the keys with p > 0, max_weight = max p, key_weight = sum of p down the
rows, lse = log(sum over readable keys of exp(score) [+ exp(sink)]); a row that may read nothing has lse -inf
and zeros elsewhere.

Shapes:
    pattern (b, h, s_q, s_kv); scores (b, h, s_q, s_kv); readable (b, h, s_q, s_kv) bool; sinks (b, h, s_q, 1)
"""

from __future__ import annotations

import math

import torch

from tests.reference import allowed_and_additive, reference_heads


def from_pattern(pattern: torch.Tensor, scores: torch.Tensor, readable: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The four statistics in float64 from a pattern and the scores it was made of."""
    p, s = pattern.double(), scores.double()
    logs = torch.where(p > 0, p.clamp_min(1e-300).log(), torch.zeros_like(p))
    entropy = -(p * logs).sum(-1)
    any_key = readable.any(-1)
    terms = s.masked_fill(~readable, -math.inf)
    if sinks is not None:
        terms = torch.cat([terms, sinks.double().expand(*terms.shape[:-1], 1)], dim=-1)
    lse = torch.logsumexp(terms.masked_fill(~any_key[..., None], 0.0), -1).masked_fill(~any_key, -math.inf)
    return {"lse": lse, "entropy": entropy, "max_weight": p.amax(-1) if p.shape[-1] else p.sum(-1),
            "key_weight": p.sum(-2)}


def reference_statistics(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                         mask: torch.Tensor | None = None, causal: bool = False, softcap: float | None = None,
                         sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """float64 context and statistics of split heads: the pattern from the per-head formula (tests/reference.py),
    the statistics from it.

    Shapes: q (b, h, s_q, d_h); k (b, h_kv, s_kv, d_h); v (b, h_kv, s_kv, d_v) -> (b, h, s_q, d_v), {...}"""
    z, pattern = reference_heads(q, k, v, mask=mask, causal=causal, scale=scale, softcap=softcap, sinks=sinks)
    b, h, s_q, _ = q.shape
    g = h // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(g, 1).transpose(-2, -1) * scale  # (b, h, s_q, s_kv)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    readable, add = allowed_and_additive(b, h, s_q, k.shape[2], mask, causal)
    rows = None
    if sinks is not None:
        rows = (sinks.view(1, h, 1, 1) if sinks.dim() == 1 else sinks).expand(b, h, s_q, 1)
    return z, from_pattern(pattern, s + add, readable, rows)


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 1e-7, atol: float = 1e-9) -> None:
    """Every statistic in ``want`` equal (whole tensors, -inf where the reference has it)."""
    for name, ref in want.items():
        torch.testing.assert_close(got[name].double().cpu(), ref.cpu(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
