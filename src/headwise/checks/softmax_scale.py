"""The scale part of the ``softmax_sanity`` property: fit each head's log-weights against its q . k.

Within a row the softmax's normaliser is one constant, so a row with n readable keys gives n - 1 data points
about the scale; a fit is only evidence when there are more data points than unknowns. Short causal inputs give
few (at seq_len=2 one row has two keys), so more random inputs are drawn until each head has
:data:`MIN_POINTS`, or the scale is reported as not checked: it is never judged from a fit that any scale and
any K/V head would satisfy. A position bias the layer adds to its scores (T5's relative position bias) is taken
out of the log-weights before the fit. Where the adapter rebuilds q and k from the projections of a layer that has
more steps that may act on them (``qk_inferred``: its ``qk_steps``, a QK-norm), a misfit may be those steps: the
scale is then reported as not checked, and the property as not verified, never as passed or failed. A layer with only
its projections (and the rotary the adapter applies) has its q and k rebuilt whole: a misfit fails.

Shapes:
    b: batch, s: tokens, h: query heads, h_kv: key/value heads, d_qk: query/key head width.
    weights (b, h, s, s); q (b, h, s, d_qk); k (b, h_kv, s, d_qk); allowed (b, 1 or h, s, s) bool;
    position bias (1, h, s, s).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .adapters import Adapter

__all__ = ["MIN_POINTS", "MAX_DRAWS", "SOFTMAX_FLOOR", "allowed_keys", "data_points", "fit_scale", "fit_capped",
           "name_scale", "check_scale"]

# Data points per head (beyond the scale itself) a fit needs before it can tell a wrong scale or a wrong K/V
# head from the right one; random scores leave a wrong candidate a large residual well before this many.
MIN_POINTS = 8
# Extra random inputs drawn at most to reach MIN_POINTS: enough for any batch at seq_len=2 (one point each).
MAX_DRAWS = 8
# Weights below float32's smallest normal number leave the fit: the softmaxes checked run in float32 or wider, and
# below it (subnormals, 0) a weight has lost the relative precision its log needs.
SOFTMAX_FLOOR = torch.finfo(torch.float32).tiny


def allowed_keys(a: Adapter, b: int, s: int, keep: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Which keys each query may read: the causal mask (and sliding window, or chunk) the layer claims, and padding.

    Shapes: keep (b, s) bool -> (b, 1, s, s) bool"""
    allowed = torch.ones(b, 1, s, s, dtype=torch.bool, device=device)
    if a.claims_causal:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool, device=device).tril()
        if a.window is not None:  # query p reads keys p - window + 1 .. p
            allowed = allowed & torch.ones(s, s, dtype=torch.bool, device=device).triu(1 - a.window)
        chunk = getattr(a, "chunk", None)
        if chunk is not None:  # Llama 4: only its own chunk, counted from the sample's first real token
            left = torch.zeros(b, 1, 1, 1, dtype=torch.long, device=device) if keep is None else \
                (keep.long().cumsum(-1) == 0).sum(-1).view(b, 1, 1, 1)
            pos = torch.arange(s, device=device)
            allowed = allowed & ((pos[None, :] - left) // chunk == (pos[:, None] - left) // chunk)
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
             draw: Callable[[], torch.Tensor], floor: float) -> tuple[torch.Tensor, ...] | None:
    """(log-weights, q, k, allowed) over the check's input and as many unpadded random inputs as the fit needs.

    Weights below ``floor`` leave the fit: a weight that underflowed to 0 or a subnormal has lost its relative
    precision, so its log says nothing about the score (peaked rows of a correct layer have them)."""
    qk = a.qk(x)
    if qk is None or not _matching(qk, w):
        return None
    ws, qs, ks, al = [w], [qk[0].double()], [qk[1].double()], [allowed]
    for _ in range(MAX_DRAWS):
        if data_points(torch.cat(al)) >= MIN_POINTS:
            break
        x2 = draw()  # (b, s, d)
        _, w2 = a.run_weights(x2)
        qk2 = a.qk(x2)
        if w2 is None or qk2 is None or w2.shape != w.shape or not _matching(qk2, w):
            break
        ws.append(w2.double())
        qs.append(qk2[0].double())
        ks.append(qk2[1].double())
        al.append(allowed_keys(a, x2.shape[0], x2.shape[1], None, w.device).expand_as(w2))
    w_all = torch.cat(ws)
    return w_all.clamp_min(1e-300).log(), torch.cat(qs), torch.cat(ks), torch.cat(al) & (w_all >= floor)


def _matching(qk: tuple[torch.Tensor, torch.Tensor], w: torch.Tensor) -> bool:
    """Whether q (b, h, s, d_qk) and k (b, h_kv, s, d_qk) have the weights' (b, h, s, s) heads and tokens, the K/V
    heads divide the query heads, and both have one width: the fit's products are then defined."""
    q, k = qk
    return isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == k.dim() == 4 \
        and tuple(q.shape[:3]) == tuple(w.shape[:3]) and k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2] \
        and k.shape[-1] == q.shape[-1] and 0 < k.shape[1] <= q.shape[1] and q.shape[1] % k.shape[1] == 0


def check_scale(a: Adapter, w: torch.Tensor, x: torch.Tensor, allowed: torch.Tensor,
                draw: Callable[[], torch.Tensor], rtol: float, floor: float = SOFTMAX_FLOOR,
                eps: float = 2 ** -52) -> tuple[tuple[str, dict, float, float] | None, str, bool]:
    """``(problem, note, unverified)``: a wrong scale (or weights that are no softmax of scaled q . k) as ``(detail,
    counterexample, deviation, tolerance)`` (the measure that failed: ``|c / expected - 1|`` against its limit, or
    the fit's relative residual against its), else None and what was verified. ``unverified`` is True where the fit
    failed on queries and keys the adapter rebuilt without the layer's own steps (``qk_inferred``): neither a pass
    nor a failure can be told, and the note says why.

    Each query head is fitted against its own K/V head (``h // (h / h_kv)``) first; another K/V head is used only
    when its own does not fit (which K/V head a query head reads is head_independence's business). A head whose
    scores are constant within every row (a zeroed W_Q) has no determinable scale: its weights must be uniform,
    and its scale is reported as not determined. A declared softcap is reported as checked only when the scores
    reach its nonlinear range (an uncapped fit would not do).

    ``floor``: weights below it leave the fit; ``eps``: the rounding unit of the dtype the softmax computes in.

    Shapes: w (b, h, s, s) float64 with rows nobody may read zeroed; x (b, s, d); allowed (b, h, s, s)"""
    if not a.d_head:
        return None, "scale not checked (the layer exposes no queries/keys)", False
    got = _samples(a, w, x, allowed, draw, floor)
    if got is None:
        return None, "scale not checked (the layer exposes no queries/keys matching its weights)", False
    logw, q, k, allowed = got
    bias = a.position_bias(x.shape[1])
    if bias is not None:  # scores = scale * q . k + bias: the log-weights less the bias are linear in q . k
        logw = logw - bias.to(logw)
    points = data_points(allowed)
    if points < MIN_POINTS:
        return None, (f"scale not checked: the weights give {points} data points per head at seq_len={x.shape[1]} "
                      f"(the fit needs {MIN_POINTS}; use a longer seq_len)"), False
    d_qk = q.shape[-1]  # the width the scores are over (DeepSeek's differs from the value heads')
    expected = a.scale or d_qk ** -0.5
    named = a.scale_source or f"1/sqrt(d_head={d_qk})"
    short = a.scale_source or f"1/sqrt({d_qk})"
    cap = a.softcap
    limit = 1e3 * rtol  # the relative residual of the log-linear fit
    # The fitted scale is a least-squares slope over >= MIN_POINTS log-weights, each off by a few roundings of the
    # softmax's dtype (float32: ~1e-7, far below its rtol of 2e-5) per unit of score spread: its relative error is
    # ~1e-6 at the spreads judged, so 10 * rtol (float32: 2e-4, float64: 1e-8) leaves a wide margin yet catches a
    # scale off by 0.05%.
    scale_limit = 10 * rtol
    # A log-weight is off by ~eps, so a fit over scores spread by `spread` within rows gets the scale to
    # ~eps / spread: below this spread (float32: 6e-3, float64: 2e-7, bfloat16: 0.25) that is no longer a tenth of
    # scale_limit, and the scale is judged against the looser 1e3 * rtol (a wrong scale is off by a factor, tiny
    # scores included); below a thousandth of it the scores are constant and the scale is not determined.
    min_spread = 10 * eps / scale_limit
    loose_limit = 1e3 * rtol
    h_q, h_kv = q.shape[1], k.shape[1]
    group = h_q // h_kv if h_kv and h_q % h_kv == 0 else None
    capped: list[bool] = []  # per fit: did the scores reach the cap's nonlinear range

    def centred(t: torch.Tensor, al: torch.Tensor) -> torch.Tensor:
        n = al.sum(-1, keepdim=True).clamp_min(1)
        t = torch.where(al, t, 0.0)
        return torch.where(al, t - t.sum(-1, keepdim=True) / n, 0.0)

    def fit(h: int, g: int) -> tuple[float, float]:
        raw = q[:, h] @ k[:, g].transpose(-2, -1)  # (b, s, s)
        al = allowed[:, h]
        spread = float((expected * centred(raw, al)).abs().max()) if al.any() else 0.0
        within = scale_limit if spread >= min_spread else loose_limit
        if spread < min_spread / 1e3:  # constant scores: uniform weights are all that can be asked
            return math.nan, float(centred(logw[:, h], al).abs().max()) if al.any() else 0.0, within
        if cap is None:
            return (*fit_scale(logw[:, h], raw, al), within)
        # Under a declared softcap the log-weights are linear in the capped scores (coefficient 1) at the scale
        # inside the cap: that scale is fitted. Scores that never reach the cap's nonlinear range (their capped
        # values are linear in them within the fit's tolerance) fit with or without a cap: they say nothing of it.
        scaled = expected * raw
        capped.append(fit_scale(cap * torch.tanh(scaled / cap), scaled, al)[1] > limit)
        return (*fit_capped(logw[:, h], raw, al, cap, expected), within)

    fits = []
    for h in range(h_q):
        own = fit(h, h // group) if group else None
        if own is not None and own[1] <= limit:
            fits.append(own)
            continue
        fits.append(min([fit(h, g) for g in range(h_kv)], key=lambda r: r[1]))
    bad_fit = [(h, c, r) for h, (c, r, _) in enumerate(fits) if r > limit]
    bad_scale = [(h, c, within) for h, (c, _, within) in enumerate(fits)
                 if not math.isnan(c) and abs(c / expected - 1) > within]
    if bad_fit:
        h, c, r = bad_fit[0]
        what = "weights are not uniform over keys with equal scores" if math.isnan(c) else \
            f"log-weights are not linear in q . k{'' if cap is None else f' capped at {cap:g}'}"
        measure = "max log-weight spread" if math.isnan(c) else "relative residual"
        if a.qk_inferred:  # q . k rebuilt from the projections: the layer's own steps may act on q and k first
            steps = ", ".join(a.qk_steps) or "steps"
            return None, (f"scale not checked: head {h}'s {what} as rebuilt from q_proj and k_proj ({measure} "
                          f"{r:.2g}), and the layer has {steps} that may transform its queries and keys (a QK-norm) "
                          "before the scores (an Adapter whose qk() returns the q and k its scores see lets it be "
                          "checked)"), True
        return ("weights are not a softmax of scaled q . k over keys", {"head": h, "residual": r, "limit": limit,
                "summary": f"head {h}'s {what} ({measure} {r:.2g}, limit {limit:.2g})"},
                r, limit), "", False
    if bad_scale:
        h, c, within = bad_scale[0]
        off = abs(c / expected - 1)
        return ("wrong scale", {"head": h, "fitted_scale": c, "expected_scale": expected, "relative_error": off,
                "limit": within, "summary": f"head {h} scales scores by {name_scale(c, d_qk, a.d_model)}, "
                f"expected {expected:.6g} = {named} (|fitted / expected - 1| = {off:.3g}, limit {within:.2g})"},
                off, within), "", False
    dead = [h for h, (c, _, _) in enumerate(fits) if math.isnan(c)]
    if len(dead) == h_q:
        return None, (f"scale not determined: every head's scores are constant within rows (spread below "
                      f"{min_spread / 1e3:.2g})"), False
    where = "every head" if not dead else f"every head but {dead} (constant scores: scale not determined)"
    if bias is not None:
        where += " (less its relative position bias)"
    if cap is None:
        capped_note = ""
    elif any(capped):
        capped_note = f", softcap {cap:g}"
    else:
        capped_note = f"; softcap {cap:g} not checked (the scores never reach its nonlinear range)"
    return None, f"scale {short} fitted on {where}{capped_note}", False
