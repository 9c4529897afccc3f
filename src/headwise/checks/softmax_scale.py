"""The scale part of the ``softmax_sanity`` property: fit each head's log-weights against its q . k.

Within a row the softmax's normaliser is one constant, so a row with n readable keys gives n - 1 data points
about the scale; a fit is only evidence when there are more data points than unknowns. Short causal inputs give
few (at seq_len=2 one row has two keys), so more random inputs are drawn until each head has
:data:`MIN_POINTS`, or the scale is reported as not checked: it is never judged from a fit that any scale and
any K/V head would satisfy.

Shapes:
    b: batch, s: tokens, h: query heads, h_kv: key/value heads, d_qk: query/key head width.
    weights (b, h, s, s); q (b, h, s, d_qk); k (b, h_kv, s, d_qk); allowed (b, 1 or h, s, s) bool.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .adapters import Adapter

__all__ = ["MIN_POINTS", "MAX_DRAWS", "allowed_keys", "data_points", "fit_scale", "fit_capped", "name_scale",
           "check_scale"]

# Data points per head (beyond the scale itself) a fit needs before it can tell a wrong scale or a wrong K/V
# head from the right one; random scores leave a wrong candidate a large residual well before this many.
MIN_POINTS = 8
# Extra random inputs drawn at most to reach MIN_POINTS: enough for any batch at seq_len=2 (one point each).
MAX_DRAWS = 8


def allowed_keys(a: Adapter, b: int, s: int, keep: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Which keys each query may read: the causal mask (and sliding window) the layer claims, and padding.

    Shapes: keep (b, s) bool -> (b, 1, s, s) bool"""
    allowed = torch.ones(b, 1, s, s, dtype=torch.bool, device=device)
    if a.claims_causal:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool, device=device).tril()
        if a.window is not None:  # query p reads keys p - window + 1 .. p
            allowed = allowed & torch.ones(s, s, dtype=torch.bool, device=device).triu(1 - a.window)
    if keep is not None:
        allowed = allowed & keep[:, None, None, :]
    return allowed


def data_points(allowed: torch.Tensor) -> int:
    """The fewest data points any head's fit gets: a row with n readable keys gives n - 1.

    Shapes: allowed (b, h, s, s) bool"""
    per_row = (allowed.sum(-1) - 1).clamp_min(0)  # (b, h, s)
    return int(per_row.sum((0, 2)).min()) if per_row.numel() else 0


def fit_scale(logw: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor) -> tuple[float, float]:
    """Least-squares c in ``log w = c * scores - logsumexp`` over allowed entries; returns (c, residual)."""
    n = allowed.sum(-1, keepdim=True).clamp_min(1)
    lw = torch.where(allowed, logw, 0.0)
    sc = torch.where(allowed, scores, 0.0)
    lw_c = torch.where(allowed, lw - lw.sum(-1, keepdim=True) / n, 0.0)  # rows centred: logsumexp drops out
    sc_c = torch.where(allowed, sc - sc.sum(-1, keepdim=True) / n, 0.0)
    c = float((lw_c * sc_c).sum() / (sc_c * sc_c).sum().clamp_min(1e-300))
    resid = float((lw_c - c * sc_c).norm() / lw_c.norm().clamp_min(1e-300))
    return c, resid


def fit_capped(logw: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor, cap: float,
               expected: float) -> tuple[float, float]:
    """The scale c inside a softcap, ``log w = a * cap * tanh(c * scores / cap) - logsumexp``: the declared one
    when it fits with a = 1, else the best of a log grid around it (the cap makes c not linear); returns (c, the
    residual of that fit, counting a != 1 as misfit)."""
    def misfit(c: float) -> float:
        a, r = fit_scale(logw, cap * torch.tanh(c * scores / cap), allowed)
        return r + abs(a - 1)

    if misfit(expected) < 1e-6:
        return expected, misfit(expected)
    grid = [expected * 2 ** (i / 16) for i in range(-96, 97)]
    c = min(grid, key=misfit)
    lo, hi = c * 2 ** -(1 / 16), c * 2 ** (1 / 16)
    for _ in range(40):  # golden-section refinement inside the best grid cell
        m1, m2 = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
        lo, hi = (lo, m2) if misfit(m1) < misfit(m2) else (m1, hi)
    c = (lo + hi) / 2
    return c, misfit(c)


def name_scale(c: float, d_head: int, d_model: int) -> str:
    for label, value in (("1/sqrt(d_head)", d_head ** -0.5), ("1/d_head", 1 / d_head),
                         ("1/sqrt(d_model)", d_model ** -0.5), ("1 (no scale)", 1.0), ("1/d_model", 1 / d_model)):
        if math.isclose(c, value, rel_tol=1e-3):
            return f"{c:.6g} = {label}"
    return f"{c:.6g}"


def _samples(a: Adapter, w: torch.Tensor, x: torch.Tensor, allowed: torch.Tensor,
             draw: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
    """(log-weights, q, k, allowed) over the check's input and as many unpadded random inputs as the fit needs."""
    qk = a.qk(x)
    if qk is None:
        return None
    ws, qs, ks, al = [w], [qk[0].double()], [qk[1].double()], [allowed]
    for _ in range(MAX_DRAWS):
        if data_points(torch.cat(al)) >= MIN_POINTS:
            break
        x2 = draw()  # (b, s, d)
        _, w2 = a.run_weights(x2)
        qk2 = a.qk(x2)
        if w2 is None or qk2 is None or w2.shape != w.shape:
            break
        ws.append(w2.double())
        qs.append(qk2[0].double())
        ks.append(qk2[1].double())
        al.append(allowed_keys(a, x2.shape[0], x2.shape[1], None, w.device).expand_as(w2))
    return torch.cat(ws).clamp_min(1e-300).log(), torch.cat(qs), torch.cat(ks), torch.cat(al)


def check_scale(a: Adapter, w: torch.Tensor, x: torch.Tensor, allowed: torch.Tensor,
                draw: Callable[[], torch.Tensor], rtol: float) -> tuple[tuple[str, dict] | None, str]:
    """``(problem, note)``: a wrong scale (or weights that are no softmax of scaled q . k) as ``(detail,
    counterexample)``, else None and what was verified.

    Each query head is fitted against its own K/V head (``h // (h / h_kv)``) first; another K/V head is used only
    when its own does not fit (which K/V head a query head reads is head_independence's business).

    Shapes: w (b, h, s, s) float64 with rows nobody may read zeroed; x (b, s, d); allowed (b, h, s, s)"""
    if not a.d_head:
        return None, "scale not checked (the layer exposes no queries/keys)"
    got = _samples(a, w, x, allowed, draw)
    if got is None:
        return None, "scale not checked (the layer exposes no queries/keys)"
    logw, q, k, allowed = got
    points = data_points(allowed)
    if points < MIN_POINTS:
        return None, (f"scale not checked: the weights give {points} data points per head at seq_len={x.shape[1]} "
                      f"(the fit needs {MIN_POINTS}; use a longer seq_len)")
    d_qk = q.shape[-1]  # the width the scores are over (DeepSeek's differs from the value heads')
    expected = a.scale or d_qk ** -0.5
    named = a.scale_source or f"1/sqrt(d_head={d_qk})"
    short = a.scale_source or f"1/sqrt({d_qk})"
    cap = a.softcap
    limit = 1e3 * rtol
    h_q, h_kv = q.shape[1], k.shape[1]
    group = h_q // h_kv if h_kv and h_q % h_kv == 0 else None

    def fit(h: int, g: int) -> tuple[float, float]:
        raw = q[:, h] @ k[:, g].transpose(-2, -1)  # (b, s, s)
        # Under a declared softcap the log-weights are linear in the capped scores (coefficient 1) at the scale
        # inside the cap: that scale is fitted.
        return fit_scale(logw[:, h], raw, allowed[:, h]) if cap is None else \
            fit_capped(logw[:, h], raw, allowed[:, h], cap, expected)

    fits = []
    for h in range(h_q):
        own = fit(h, h // group) if group else None
        if own is not None and own[1] <= limit:
            fits.append(own)
            continue
        fits.append(min([fit(h, g) for g in range(h_kv)], key=lambda r: r[1]))
    bad_fit = [(h, c, r) for h, (c, r) in enumerate(fits) if r > limit]
    bad_scale = [(h, c) for h, (c, r) in enumerate(fits) if abs(c / expected - 1) > limit]
    if bad_fit:
        h, c, r = bad_fit[0]
        return ("weights are not a softmax of scaled q . k over keys", {"head": h, "residual": r,
                "summary": f"head {h}'s log-weights are not linear in q . k"
                           f"{'' if cap is None else f' capped at {cap:g}'} (relative residual {r:.2g})"}), ""
    if bad_scale:
        h, c = bad_scale[0]
        return ("wrong scale", {"head": h, "fitted_scale": c, "expected_scale": expected,
                "summary": f"head {h} scales scores by {name_scale(c, d_qk, a.d_model)}, "
                           f"expected {expected:.6g} = {named}"}), ""
    return None, f"scale {short} fitted on every head" + ("" if cap is None else f", softcap {cap:g}")
