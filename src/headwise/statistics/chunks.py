"""Per-head attention statistics with PyTorch operations, a bounded chunk of query rows at a time.

Each chunk of ``c`` query rows computes its scores against the keys any of its rows may read (causal and
masked keys outside that span are never touched), then from the same scores: the row maximum ``m``, the
probabilities up to their normaliser (``e = exp(score - m)``, ``l = sum e``), the context ``e @ V / l`` and
every statistic:

* ``lse = m + log l`` (plus the sink's ``exp(sink - m)`` in ``l``: a sink's share is mass on no key);
* ``max_weight = exp(max score - lse)``;
* ``entropy = -sum_j p_j log p_j`` over the keys, ``= (sum_j p_j) (lse - m) - sum_j p_j (score_j - m)``, so
  the shifted scores the exponentials were made of give it in one more dot product per row;
* ``key_weight += sum over rows of p``: one ``(1, c) @ (c, keys)`` product per chunk.

A chunk's scores and exponentials are the only pattern-sized memory: ``b * h * c * keys`` floats each, with
``c`` chosen so that one is at most :data:`headwise.plan.STATISTICS_CHUNK_BYTES` (8 rows where 8 rows
are larger: fewer would read the keys once per row). Under ``torch.autocast`` the products run with it switched off, in the statistics' own float32
(float64). Rows that may read no key (every key masked off by a bool mask or ``-inf``) give ``lse = -inf``,
entropy, maximum, context and key weights 0. A floating mask's very negative but finite entries (Hugging
Face's ``finfo.min`` padding) are scores like any other, as in the softmax: a row made only of them spreads its
weight evenly, as the eager formula does.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d_h: query/key head width, d_v: value head width, g = h // h_kv, c: rows per chunk, n: keys a chunk reads.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ..plan import statistics_rows

__all__ = ["chunked_statistics"]

#: Shifted scores are clamped here before use: exp(-1000) is 0 in float32 and float64, and the clamp keeps a
#: masked (-inf) score from turning its zero weight times its score into NaN.
_FLOOR = -1000.0
_NAMES = ("lse", "entropy", "max_weight", "key_weight")


def _span(allowed: torch.Tensor) -> tuple[int, int]:
    """First and one-past-last column that is True anywhere in ``allowed`` (``(0, 0)`` if none; every column
    inside compiled code).

    Shapes: allowed (..., n) -> two ints"""
    if torch.compiler.is_compiling():
        # Where the columns lie is data, which a compiled graph cannot branch on: every column, which computes
        # the same numbers (masking a column the mask already allows changes nothing).
        return 0, allowed.shape[-1]
    cols = allowed.flatten(0, -2).any(0) if allowed.dim() > 1 else allowed  # (n,)
    idx = cols.nonzero()
    if idx.numel() == 0:
        return 0, 0
    return int(idx[0]), int(idx[-1]) + 1


def chunked_statistics(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None,
    causal: bool = False, softcap: float | None = None, sinks: torch.Tensor | None = None,
    names: tuple[str, ...] = _NAMES, need_z: bool = True, rows: int | None = None,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The context and the statistics ``names`` of softmax attention, in query chunks (no autograd).

    Args:
        q, k, v: split heads; query head i reads K/V head i // g.
        scale: the score scale.
        mask: bool (True = may attend) or floating (added to the scores), 4-D, broadcastable to (b, h, s_q, s_kv).
        causal: bottom-right causal masking (query i sits at position s_kv - s_q + i).
        softcap: scores become ``softcap * tanh(score / softcap)`` before the mask.
        sinks: one logit per head ``(h,)`` or per row ``(b or 1, h, s_q or 1, 1)`` that takes probability and
            carries no value.
        names: which of ``lse``, ``entropy``, ``max_weight``, ``key_weight`` to return.
        need_z: also compute the context (False: the caller has it from another path).
        rows: query rows per chunk (default :func:`headwise.plan.statistics_rows`).

    Shapes:
        q: (b, h, s_q, d_h); k: (b, h_kv, s_kv, d_h); v: (b, h_kv, s_kv, d_v)
        -> z (b, h, s_q, d_v) in q's dtype (or None); lse, entropy, max_weight (b, h, s_q) and key_weight
        (b, h, s_kv) in float32 (float64 for float64 inputs), whatever ``torch.autocast`` is active: the products
        run with it switched off
    """
    b, h, s_q, d_h = q.shape
    h_kv, s_kv, d_v = k.shape[1], k.shape[2], v.shape[-1]
    g = h // h_kv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    want = set(names)
    out: dict[str, torch.Tensor] = {}
    lse = torch.full((b, h, s_q), float("-inf"), dtype=acc, device=dev)
    ent = torch.zeros(b, h, s_q, dtype=acc, device=dev) if "entropy" in want else None
    top = torch.zeros(b, h, s_q, dtype=acc, device=dev) if "max_weight" in want else None
    kw = torch.zeros(b, h, 1, s_kv, dtype=acc, device=dev) if "key_weight" in want else None
    z = q.new_zeros(b, h, s_q, d_v) if need_z else None
    if b and h and s_q and s_kv:
        c = rows or statistics_rows(b, h, s_q, s_kv, torch.finfo(acc).bits // 8)
        kt = k.to(acc).transpose(-2, -1).contiguous()  # (b, h_kv, d_h, s_kv): row-major for the score products
        vv = v.to(acc) if need_z else None
        full = None if mask is None else mask.expand(*mask.shape[:2], mask.shape[2], s_kv)  # (B, H, s_q or 1, s_kv)
        sink = None
        if sinks is not None:
            sink = (sinks.view(1, h, 1, 1) if sinks.dim() == 1 else sinks).to(acc)  # (b or 1, h, s_q or 1, 1)
        kind = dev.type
        # An active torch.autocast would run the products below in its dtype (bfloat16 on CPU), far from the
        # float32 the statistics promise: switched off here, where no autocast exists to switch (meta) left be.
        off = torch.autocast(kind, enabled=False) if torch.amp.is_autocast_available(kind) else nullcontext()
        with off:
            for i0 in range(0, s_q, c):
                i1 = min(s_q, i0 + c)
                _chunk(q, kt, vv, full, sink, i0, i1, scale, causal, softcap, g, lse, ent, top, kw, z)
    out["lse"] = lse
    if ent is not None:
        out["entropy"] = ent
    if top is not None:
        out["max_weight"] = top
    if kw is not None:
        out["key_weight"] = kw.squeeze(2)
    return z, {n: out[n] for n in names}


def _chunk(q, kt, vv, full, sink, i0, i1, scale, causal, softcap, g, lse, ent, top, kw, z) -> None:  # type: ignore[no-untyped-def]
    """Rows ``[i0, i1)``: scores against the keys they may read, then every requested output in place."""
    b, h, s_q, d_h = q.shape
    h_kv, s_kv = kt.shape[1], kt.shape[-1]
    c = i1 - i0
    off = s_kv - s_q  # bottom-right: query i reads keys j <= i + off
    hi = max(0, min(s_kv, i1 + off)) if causal else s_kv
    lo, rows_mask = 0, None
    if full is not None:
        rows_mask = full if full.shape[2] == 1 else full[:, :, i0:i1]  # (B, H, c or 1, s_kv)
        allowed = rows_mask if rows_mask.dtype == torch.bool else rows_mask > float("-inf")
        lo, hi_m = _span(allowed[..., :hi])
        hi = hi_m if hi_m > lo else lo
    if hi <= lo:  # no row of this chunk may read a key: the defaults (lse -inf, zeros) stand
        return
    # Columns that need masking: the causal diagonal, and wherever the mask is not "may attend" for every row.
    regions = []
    if causal and i0 + off + 1 < hi:
        regions.append((max(lo, i0 + off + 1), hi))
    if rows_mask is not None:
        region = rows_mask[..., lo:hi]
        a, e = _span(~region if region.dtype == torch.bool else region != 0)
        if e > a:
            regions.append((lo + a, lo + e))
    masked = bool(regions)
    m0, m1 = (min(r[0] for r in regions), max(r[1] for r in regions)) if masked else (hi, hi)
    n = hi - lo
    qc = (q[:, :, i0:i1].to(kt.dtype) * scale).reshape(b, h_kv, g * c, d_h)  # (b, h_kv, g * c, d_h)
    s = torch.matmul(qc, kt[..., lo:hi]).view(b, h, c, n)  # (b, h, c, n) scores
    if softcap is not None:
        s.div_(softcap).tanh_().mul_(softcap)
    if masked:
        part = s[..., m0 - lo:m1 - lo]  # (b, h, c, m1 - m0): a view, edited in place
        if rows_mask is not None:
            r = rows_mask[..., m0:m1]
            if r.dtype == torch.bool:
                part.masked_fill_(~r, float("-inf"))
            else:
                part.add_(r.to(s.dtype))
        if causal:
            cols = torch.arange(m0, m1, device=s.device)
            rows_at = torch.arange(i0, i1, device=s.device)[:, None] + off  # (c, 1)
            part.masked_fill_(cols[None, :] > rows_at, float("-inf"))
    mx = s.amax(-1, keepdim=True)  # (b, h, c, 1): the largest score on a key
    ref = mx if sink is None else torch.maximum(mx, _rows(sink, i0, i1))
    ref = torch.where(torch.isinf(ref), 0.0, ref)  # a row with no readable key: any finite reference
    s.sub_(ref)
    if masked:
        s[..., m0 - lo:m1 - lo].clamp_(min=_FLOOR)
    e = torch.exp(s)  # (b, h, c, n)
    l_keys = e.sum(-1, keepdim=True)  # (b, h, c, 1)
    total = l_keys if sink is None else l_keys + torch.exp(_rows(sink, i0, i1) - ref)
    dead = torch.isneginf(mx)  # (b, h, c, 1): no readable key (not l_keys == 0: a far larger sink underflows them)
    inv = torch.where(dead, 0.0, 1.0 / torch.where(dead, 1.0, total))
    log_total = torch.log(torch.where(dead, 1.0, total))
    lse[:, :, i0:i1] = torch.where(dead, float("-inf"), ref + log_total).squeeze(-1)
    if ent is not None:
        shifted = torch.einsum("bhcn,bhcn->bhc", e, s).unsqueeze(-1)  # (b, h, c, 1): sum_j e_j (score_j - ref)
        h_row = (l_keys * log_total - shifted) * inv
        ent[:, :, i0:i1] = torch.where(dead, 0.0, h_row).squeeze(-1).clamp_(min=0.0)
    if top is not None:
        top[:, :, i0:i1] = torch.where(dead, 0.0, torch.exp(mx - ref - log_total)).squeeze(-1)
    if kw is not None:
        kw[..., lo:hi] += torch.matmul(inv.transpose(-2, -1), e)  # (b, h, 1, n)
    if z is not None:
        ctx = torch.matmul(e.view(b, h_kv, g * c, n), vv[:, :, lo:hi]).view(b, h, c, -1)  # (b, h, c, d_v)
        z[:, :, i0:i1] = (ctx * inv).to(z.dtype)


def _rows(sink: torch.Tensor, i0: int, i1: int) -> torch.Tensor:
    """The sink logits of rows ``[i0, i1)``. Shapes: (b or 1, h, s_q or 1, 1) -> (b or 1, h, c or 1, 1)"""
    return sink if sink.shape[2] == 1 else sink[:, :, i0:i1]

