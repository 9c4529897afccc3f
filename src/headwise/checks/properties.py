"""The seven properties every attention layer must satisfy, one function each.

Each takes a :class:`Probe` (the adapter, seeded inputs and tolerances) and returns a
:class:`~headwise.checks.report.PropertyResult`. Deviations are measured as max absolute differences and
judged against a tolerance relative to the output's scale (``rtol * max|y|``), in float64 when the layer
can run in it. Counterexamples are the smallest indices that show a violation.

Shapes:
    b: batch, s: tokens, d: d_model, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .adapters import Adapter
from .report import FAIL, PASS, SKIPPED, PropertyResult

__all__ = ["Probe", "PROPERTIES", "permutation_equivariance", "batch_independence", "causality",
           "padding_invariance", "softmax_sanity", "head_independence", "dtype_stability"]

# Relative tolerances: reorderings of float sums cost a few ulps times the reduction length.
RTOL = {torch.float64: 1e-9, torch.float32: 2e-5}
# float32 vs float64 of the same layer: float32 rounding through projections and softmax.
DTYPE_RTOL = 1e-4


@dataclass
class Probe:
    """What the properties share: the adapter in the compute dtype, seeded inputs and tolerances.

    Shapes:
        x: (b, s, d); keep: (b, s) bool, True = real token (sample 0 full, 1 right-padded, 2 left-padded)
    """

    adapter: Adapter
    x: torch.Tensor
    keep: torch.Tensor
    generator: torch.Generator
    seed: int

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def rtol(self) -> float:
        rtol = RTOL.get(self.dtype, 1e-3)
        if self.adapter.precision is not None:
            rtol = max(rtol, RTOL.get(self.adapter.precision, 1e-3))
        return rtol

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, dtype=torch.float64).to(self.dtype).to(self.x.device)

    def tol(self, reference: torch.Tensor, rtol: float | None = None) -> float:
        finite = reference[torch.isfinite(reference)]
        scale = float(finite.abs().max()) if finite.numel() else 1.0
        return (self.rtol if rtol is None else rtol) * max(scale, 1e-12)


def _dev(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise |a - b| where non-finite values count as infinitely wrong (unless identical)."""
    d = (a.double() - b.double()).abs()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))  # the same inf, or NaN in both: no change
    bad = ~(torch.isfinite(a) & torch.isfinite(b)) & ~same
    return torch.where(bad, torch.full_like(d, math.inf), torch.where(same, torch.zeros_like(d), d))


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def _nonfinite(name: str, y: torch.Tensor) -> PropertyResult | None:
    if torch.isfinite(y).all():
        return None
    idx = _first(~torch.isfinite(y))
    return PropertyResult(name, FAIL, "the layer's output is not finite",
                          {"index": list(idx), "summary": f"non-finite output at (batch, token, ...) = {idx}"},
                          math.inf, 0.0)


def _skip(name: str, why: str) -> PropertyResult:
    return PropertyResult(name, SKIPPED, why)


# -- 1 ------------------------------------------------------------------------------------------------------
def permutation_equivariance(p: Probe) -> PropertyResult:
    """Permuting tokens (without positions) permutes the outputs: ``f(x[:, perm]) == f(x)[:, perm]``.
    Catches token/head flattening bugs. Layers with positions (rotary) get the positions permuted too."""
    name = "permutation_equivariance"
    a = p.adapter
    if a.claims_causal and not a.accepts_causal:
        return _skip(name, "the layer is causal only, so token order is part of its function")
    s = p.x.shape[1]
    perm = torch.randperm(s, generator=p.generator)
    if torch.equal(perm, torch.arange(s)):  # the identity would prove nothing
        perm = torch.roll(perm, 1)
    kw = {"causal": False} if a.accepts_causal else {}
    y = a.run(p.x, **kw)
    if (bad := _nonfinite(name, y)) is not None:
        return bad
    positions = perm.to(p.x.device) if a.positional else None
    y_perm = a.run(p.x[:, perm], positions=positions, **kw) if positions is not None else a.run(p.x[:, perm], **kw)
    dev = _dev(y_perm, y[:, perm]).amax(-1)  # (b, s)
    tol = p.tol(y)
    worst = float(dev.max())
    if worst <= tol:
        return PropertyResult(name, PASS, f"tokens permuted by {perm.tolist()}"
                              + (" with their positions" if positions is not None else ""), None, worst, tol)
    bi, ti = _first(dev > tol)
    return PropertyResult(name, FAIL, "outputs do not follow their tokens", {
        "permutation": perm.tolist(), "batch": bi, "token": int(perm[ti]), "moved_to": ti,
        "deviation": float(dev[bi, ti]),
        "summary": f"token {int(perm[ti])} of sample {bi}, moved to position {ti}, got a different output "
                   f"(max |diff| {float(dev[bi, ti]):.3g})"}, worst, tol)


# -- 2 ------------------------------------------------------------------------------------------------------
def batch_independence(p: Probe) -> PropertyResult:
    """Changing sample j never changes sample i != j."""
    name = "batch_independence"
    b, s, d = p.x.shape
    if b < 2:
        return _skip(name, "needs batch >= 2")
    a = p.adapter
    y = a.run(p.x)
    if (bad := _nonfinite(name, y)) is not None:
        return bad
    j = 1
    x2 = p.x.clone()
    x2[j] = p.randn(s, d)
    y2 = a.run(x2)
    others = [i for i in range(b) if i != j]
    dev = _dev(y2[others], y[others]).amax(-1)  # (b - 1, s)
    tol = p.tol(y)
    worst = float(dev.max())
    if worst <= tol:
        return PropertyResult(name, PASS, f"changed sample {j} of {b}", None, worst, tol)
    oi, ti = _first(dev > tol)
    i = others[oi]
    return PropertyResult(name, FAIL, "samples leak into each other", {
        "changed_sample": j, "sample": i, "token": ti, "deviation": float(dev[oi, ti]),
        "summary": f"changing sample {j} changed sample {i} at token {ti} (max |diff| {float(dev[oi, ti]):.3g})"},
        worst, tol)


# -- 3 ------------------------------------------------------------------------------------------------------
def causality(p: Probe) -> PropertyResult:
    """For a layer that claims causality: changing token t never changes outputs before t (nor, under a
    sliding window w, outputs at t + w or later: a query reads nothing more than w - 1 back); and, when the
    layer has a KV-cache path, prefill-then-decode equals the full causal pass."""
    name = "causality"
    a = p.adapter
    if not a.claims_causal:
        return _skip(name, "the layer does not claim causality (check it with causal=True)")
    b, s, d = p.x.shape
    y = a.run(p.x)
    if (bad := _nonfinite(name, y)) is not None:
        return bad
    tol = p.tol(y)
    worst = 0.0
    for t in range(1, s):
        x2 = p.x.clone()
        x2[:, t] = p.randn(b, d)
        y2 = a.run(x2)
        dev = _dev(y2[:, :t], y[:, :t]).amax(-1)  # (b, t)
        worst = max(worst, float(dev.max()))
        if a.window is not None and t + a.window < s:  # nor outputs w or more tokens after t
            far = _dev(y2[:, t + a.window:], y[:, t + a.window:]).amax(-1)  # (b, s - t - w)
            worst = max(worst, float(far.max()))
            if float(far.max()) > tol:
                bi, pos = _first(far > tol)
                return PropertyResult(name, FAIL, f"an output reads past its sliding window of {a.window}", {
                    "changed_token": t, "batch": bi, "output_token": pos + t + a.window, "window": a.window,
                    "deviation": float(far[bi, pos]), "summary": f"changing token {t} changed the output at "
                    f"token {pos + t + a.window} (sample {bi}), outside the window"}, float(far.max()), tol)
        if float(dev.max()) > tol:
            bi, pos = _first(dev > tol)
            return PropertyResult(name, FAIL, "an output reads a later token", {
                "changed_token": t, "batch": bi, "output_token": pos, "deviation": float(dev[bi, pos]),
                "summary": f"changing token {t} changed the output at token {pos} (sample {bi}, "
                           f"max |diff| {float(dev[bi, pos]):.3g})"}, float(dev.max()), tol)
    note = f"changed each token 1..{s - 1}" + ("" if a.window is None else f" (sliding window {a.window})")
    if a.has_cache:
        prefill = s // 2
        y_dec = a.decode(p.x, prefill)
        dev = _dev(y_dec, y).amax(-1)  # (b, s)
        worst = max(worst, float(dev.max()))
        if float(dev.max()) > tol:
            bi, pos = _first(dev > tol)
            return PropertyResult(name, FAIL, "decoding with the cache differs from the full causal pass", {
                "prefill": prefill, "batch": bi, "token": pos, "deviation": float(dev[bi, pos]),
                "summary": f"prefill {prefill} then decode: token {pos} differs from the full pass "
                           f"(sample {bi}, max |diff| {float(dev[bi, pos]):.3g})"}, float(dev.max()), tol)
        note += f"; prefill {prefill} + decode {s - prefill} tokens with the cache == full pass"
    else:
        note += "; no cache path to compare"
    return PropertyResult(name, PASS, note, None, worst, tol)


# -- 4 ------------------------------------------------------------------------------------------------------
def padding_invariance(p: Probe) -> PropertyResult:
    """Changing padded tokens (masked keys) never changes the outputs of real tokens."""
    name = "padding_invariance"
    a = p.adapter
    if not a.accepts_mask:
        return _skip(name, "the layer takes no padding mask")
    y = a.run(p.x, keep=p.keep)
    real = p.keep
    if (bad := _nonfinite(name, y[real])) is not None:
        idx = _first(~torch.isfinite(y).all(-1) & real)
        return PropertyResult(name, FAIL, bad.detail, {"batch": idx[0], "token": idx[1], "summary":
                              f"non-finite output at real token {idx[1]} of sample {idx[0]}"}, math.inf, 0.0)
    x2 = torch.where(p.keep[..., None], p.x, p.randn(*p.x.shape))
    y2 = a.run(x2, keep=p.keep)
    dev = _dev(y2, y).amax(-1).masked_fill(~real, 0.0)  # (b, s), real tokens only
    tol = p.tol(y[real])
    worst = float(dev.max())
    lengths = p.keep.sum(-1).tolist()
    if worst <= tol:
        return PropertyResult(name, PASS, f"real tokens per sample {lengths} (right and left padding)",
                              None, worst, tol)
    bi, ti = _first(dev > tol)
    return PropertyResult(name, FAIL, "padded tokens leak into real ones", {
        "batch": bi, "token": ti, "deviation": float(dev[bi, ti]), "keep": p.keep[bi].int().tolist(),
        "summary": f"changing padded tokens of sample {bi} changed its real token {ti} "
                   f"(max |diff| {float(dev[bi, ti]):.3g})"}, worst, tol)


# -- 5 ------------------------------------------------------------------------------------------------------
def _fit_scale(logw: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor) -> tuple[float, float]:
    """Least-squares c in ``log w = c * scores - logsumexp`` over allowed entries; returns (c, residual)."""
    n = allowed.sum(-1, keepdim=True).clamp_min(1)
    lw = torch.where(allowed, logw, 0.0)
    sc = torch.where(allowed, scores, 0.0)
    lw_c = torch.where(allowed, lw - lw.sum(-1, keepdim=True) / n, 0.0)  # rows centred: logsumexp drops out
    sc_c = torch.where(allowed, sc - sc.sum(-1, keepdim=True) / n, 0.0)
    c = float((lw_c * sc_c).sum() / (sc_c * sc_c).sum().clamp_min(1e-300))
    resid = float((lw_c - c * sc_c).norm() / lw_c.norm().clamp_min(1e-300))
    return c, resid


def _fit_capped(logw: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor, cap: float,
                expected: float) -> tuple[float, float]:
    """The scale c inside a softcap, ``log w = a * cap * tanh(c * scores / cap) - logsumexp``: the declared one
    when it fits with a = 1, else the best of a log grid around it (the cap makes c not linear); returns (c, the
    residual of that fit, counting a != 1 as misfit)."""
    def misfit(c: float) -> float:
        a, r = _fit_scale(logw, cap * torch.tanh(c * scores / cap), allowed)
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


def _name_scale(c: float, d_head: int, d_model: int) -> str:
    for label, value in (("1/sqrt(d_head)", d_head ** -0.5), ("1/d_head", 1 / d_head),
                         ("1/sqrt(d_model)", d_model ** -0.5), ("1 (no scale)", 1.0), ("1/d_model", 1 / d_model)):
        if math.isclose(c, value, rel_tol=1e-3):
            return f"{c:.6g} = {label}"
    return f"{c:.6g}"


def softmax_sanity(p: Probe) -> PropertyResult:
    """Where weights are exposed: each row sums to 1, masked entries are exactly 0, and the scores are
    scaled by 1/sqrt(d_head) (the scale is fitted from the weights against the head's q . k)."""
    name = "softmax_sanity"
    a = p.adapter
    if not a.exposes_weights:
        return _skip(name, "the layer exposes no attention weights")
    keep = p.keep if a.accepts_mask else None
    _, w = a.run_weights(p.x, keep=keep)
    b, s, _ = p.x.shape
    if w is None or w.dim() != 4 or tuple(w.shape[-2:]) != (s, s) or w.shape[0] != b:
        got = None if w is None else tuple(w.shape)
        return _skip(name, f"weights of shape {got} are not per head (b, h, s, s)")
    w = w.double()
    allowed = torch.ones(b, 1, s, s, dtype=torch.bool, device=w.device)
    if a.claims_causal:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool, device=w.device).tril()
        if a.window is not None:  # query p reads keys p - window + 1 .. p
            allowed = allowed & torch.ones(s, s, dtype=torch.bool, device=w.device).triu(1 - a.window)
    if keep is not None:
        allowed = allowed & keep[:, None, None, :]
    allowed = allowed.expand_as(w)
    # A query that may read no key at all (a left-padded query under a causal mask) has no defined
    # softmax (zeros in headwise, NaN in torch): such rows are not judged.
    rows = allowed.any(-1)  # (b, h, s)
    w = w.masked_fill(~rows[..., None], 0.0)
    tol = 10 * p.rtol
    problems: list[tuple[str, dict]] = []
    sums = w.sum(-1)  # (b, h, s); with sinks a row may give part of its weight to no key: sum in (0, 1]
    row_err = ((sums - 1).clamp_min(0) + (-sums).clamp_min(0) if a.sinks else (sums - 1).abs()).masked_fill(~rows, 0.0)
    if not torch.isfinite(w).all():
        idx = _first(~torch.isfinite(w))
        problems.append(("weights are not finite", {"index": list(idx), "summary":
                         f"non-finite weight at (batch, head, query, key) = {idx}"}))
    elif float(row_err.max()) > tol:
        bi, hi, qi = _first(row_err > tol)
        problems.append(("rows do not sum to 1", {"batch": bi, "head": hi, "query": qi,
                         "row_sum": float(w[bi, hi, qi].sum()), "summary": f"weights of head {hi}, query {qi} "
                         f"(sample {bi}) sum to {float(w[bi, hi, qi].sum()):.6g}, not "
                         f"{'at most 1' if a.sinks else '1'}"}))
    leaked = (w != 0) & ~allowed
    if leaked.any():
        bi, hi, qi, ki = _first(leaked)
        what = "a future key" if a.claims_causal and ki > qi else "a padded key"
        problems.append(("masked entries are not 0", {"batch": bi, "head": hi, "query": qi, "key": ki,
                         "weight": float(w[bi, hi, qi, ki]), "summary": f"head {hi}, query {qi} gives weight "
                         f"{float(w[bi, hi, qi, ki]):.3g} to {what} {ki} (sample {bi})"}))
    scale_note = "scale not checked (the layer exposes no queries/keys)"
    qk = a.qk(p.x) if not problems else None
    if qk is not None and a.d_head:
        q, k = (t.double() for t in qk)
        d_qk = q.shape[-1]  # the width the scores are over (DeepSeek's differs from the value heads')
        expected = a.scale or d_qk ** -0.5
        named = a.scale_source or f"1/sqrt(d_head={d_qk})"
        short = a.scale_source or f"1/sqrt({d_qk})"
        cap = a.softcap
        logw = w.clamp_min(1e-300).log()
        real_rows = allowed & rows[..., None]

        def raw(h: int, g: int) -> torch.Tensor:
            return q[:, h] @ k[:, g].transpose(-2, -1)  # (b, s, s)

        fits = []
        for h in range(q.shape[1]):
            # Fit against every K/V head and keep the best: which K/V head a query head reads is
            # head_independence's business, not this property's. Under a declared softcap the log-weights are
            # linear in the capped scores (coefficient 1) at the scale inside the cap: that scale is fitted.
            best = min(((_fit_scale(logw[:, h], raw(h, g), real_rows[:, h]) if cap is None else
                         _fit_capped(logw[:, h], raw(h, g), real_rows[:, h], cap, expected)) + (g,)
                        for g in range(k.shape[1])), key=lambda r: r[1])
            fits.append(best)
        bad_fit = [(h, c, r) for h, (c, r, _) in enumerate(fits) if r > 1e3 * p.rtol]
        bad_scale = [(h, c) for h, (c, r, _) in enumerate(fits) if abs(c / expected - 1) > 1e3 * p.rtol]
        if bad_fit:
            h, c, r = bad_fit[0]
            problems.append(("weights are not a softmax of scaled q . k over keys", {"head": h, "residual": r,
                             "summary": f"head {h}'s log-weights are not linear in q . k"
                                        f"{'' if cap is None else f' capped at {cap:g}'} (relative residual "
                                        f"{r:.2g})"}))
        elif bad_scale:
            h, c = bad_scale[0]
            problems.append(("wrong scale", {"head": h, "fitted_scale": c, "expected_scale": expected,
                             "summary": f"head {h} scales scores by {_name_scale(c, d_qk, a.d_model)}, "
                                        f"expected {expected:.6g} = {named}"}))
        else:
            scale_note = f"scale {short} fitted on every head" + ("" if cap is None else f", softcap {cap:g}")
    if problems:
        detail, cex = problems[0]
        return PropertyResult(name, FAIL, "; ".join(pr[0] for pr in problems), cex,
                              float(row_err.max()) if torch.isfinite(row_err).all() else math.inf, tol)
    rows_note = "rows sum to at most 1 (sinks take the rest)" if a.sinks else "rows sum to 1"
    return PropertyResult(name, PASS, f"{rows_note}, masked entries exactly 0; {scale_note}", None,
                          float(row_err.max()), tol)


# -- 6 ------------------------------------------------------------------------------------------------------
def head_independence(p: Probe) -> PropertyResult:
    """Where heads are exposed: perturbing query head h's W_Q changes only head h's context; perturbing
    K/V head g's W_K or W_V changes only the query heads of group g (``h // (n_heads / n_kv_heads)``).
    The only place heads may mix is W_O, after the contexts."""
    name = "head_independence"
    a = p.adapter
    if not a.exposes_heads:
        return _skip(name, a.no_heads_reason or "the layer exposes no heads (q/k/v projections and W_O)")
    h, h_kv = a.n_heads, a.n_kv_heads
    if not h or not h_kv or h % h_kv:
        return _skip(name, f"n_heads={h}, n_kv_heads={h_kv} do not form groups")
    g = h // h_kv
    with torch.no_grad():
        c0 = a.contexts(p.x)  # (b, h, s, d_h)
        if (bad := _nonfinite(name, c0)) is not None:
            return bad
        tol = p.tol(c0)
        worst_other = 0.0
        for which, count in (("q", h), ("k", h_kv), ("v", h_kv)):
            for i in range(count):
                with a.perturbed(which, i, p.generator):
                    c1 = a.contexts(p.x)
                dev = _dev(c1, c0).flatten(2).amax(-1).amax(0)  # (h,)
                changed = [j for j in range(h) if float(dev[j]) > tol]
                expected = [i] if which == "q" else list(range(i * g, (i + 1) * g))
                others = [j for j in range(h) if j not in expected]
                if others:
                    worst_other = max(worst_other, float(dev[others].max()))
                if changed != expected:
                    kind = f"W_{which.upper()} of {'query' if which == 'q' else 'K/V'} head {i}"
                    return PropertyResult(name, FAIL, "heads are not independent before W_O", {
                        "perturbed": f"W_{which.upper()}", "head": i, "changed_heads": changed,
                        "expected_heads": expected,
                        "summary": f"perturbing {kind} changed the contexts of heads {changed}, expected "
                                   f"{expected}"}, worst_other, tol)
    return PropertyResult(name, PASS, f"{h} query heads, {h_kv} K/V heads: every perturbation stayed in its "
                          f"head{'s group' if g > 1 else ''}", None, worst_other, tol)


# -- 7 ------------------------------------------------------------------------------------------------------
def dtype_stability(p: Probe) -> PropertyResult:
    """The same layer in float32 and float64 agrees within float32 rounding (relative to the output)."""
    name = "dtype_stability"
    a = p.adapter
    a32, a64 = a.converted(torch.float32), a.converted(torch.float64)
    if a32 is None or a64 is None:
        a32 = a64 = a
    keep = p.keep if a.accepts_mask else None
    x64 = p.x.double()
    try:
        y64 = a64.run(x64, keep=keep)
    except (RuntimeError, TypeError, ValueError) as exc:
        return _skip(name, f"the layer does not run in float64 ({type(exc).__name__}: {str(exc)[:80]})")
    y32 = a32.run(x64.float(), keep=keep)
    if y32.dtype != torch.float32 or y64.dtype != torch.float64:
        return PropertyResult(name, FAIL, "the output dtype does not follow the input dtype", {
            "summary": f"float32 input gave {y32.dtype}, float64 input gave {y64.dtype}"}, None, None)
    dev = _dev(y32, y64).amax(-1)  # (b, s)
    if keep is not None:
        dev = dev.masked_fill(~keep, 0.0)  # real tokens only
    tol = p.tol(y64[keep] if keep is not None else y64, DTYPE_RTOL)
    worst = float(dev.max())
    if worst <= tol:
        return PropertyResult(name, PASS, "float32 vs float64 on the same weights", None, worst, tol)
    bi, ti = _first(dev > tol)
    return PropertyResult(name, FAIL, "float32 and float64 disagree beyond float32 rounding", {
        "batch": bi, "token": ti, "deviation": float(dev[bi, ti]),
        "summary": f"float32 vs float64 differ by {float(dev[bi, ti]):.3g} (tolerance {tol:.2g}) at token {ti} "
                   f"of sample {bi}"}, worst, tol)


PROPERTIES: dict[str, Callable[[Probe], PropertyResult]] = {
    "permutation_equivariance": permutation_equivariance,
    "batch_independence": batch_independence,
    "causality": causality,
    "padding_invariance": padding_invariance,
    "softmax_sanity": softmax_sanity,
    "head_independence": head_independence,
    "dtype_stability": dtype_stability,
}
