"""The part of the ``softmax_sanity`` property that asks whether the layer's output is made of the weights it
returns: a layer may compute its normal output on a fused fast path and recompute weights for inspection on an
eager one, and only the eager one's would be judged.

* :func:`outputs_follow_weights`: the normal call's output equals the output of the call that returns weights.
* :func:`contexts_follow_weights`: where heads are exposed, each head's context (the input of W_O) in the normal
  call is its returned weights times its values, ``w @ v``: a fast path with another scale, or without the
  softmax's normalisation, gives other contexts even when both calls return the same output. A layer with steps
  of its own between its values and W_O (a value norm, an output gate: the adapter's ``v_steps``) may make other
  contexts correctly: there a mismatch is reported as not compared, naming them; a layer with only its projections
  fails on it.

Each returns a :data:`Problem` or None (and a note saying what was compared, or why not).

Shapes:
    b: batch, s: tokens, h: query heads, h_kv: key/value heads, d_h: head width.
    weights (b, h, s, s); values (b, h_kv, s, d_h); contexts (b, h, s, d_h).
"""

from __future__ import annotations

import torch

from .adapters import NotExposed
from .measure import Probe, deviation, first_index

__all__ = ["Problem", "outputs_follow_weights", "contexts_follow_weights"]

# (detail, counterexample, deviation, tolerance): one failed measure of a property, with the numbers it failed on
Problem = tuple[str, dict, float, float]


def outputs_follow_weights(p: Probe, y_w: torch.Tensor, keep: torch.Tensor | None) -> Problem | None:
    """The layer's normal output equals the output of the call that returns weights: the weights judged must be
    the ones its output is made of (a fused fast path beside an eager weights path can differ).

    Shapes: y_w (b, s, d); keep (b, s) bool or None"""
    y = p.adapter.run(p.x, keep=keep)
    if not isinstance(y_w, torch.Tensor) or y_w.shape != y.shape:
        return None
    dev = deviation(y, y_w).amax(-1)  # (b, s)
    if keep is not None:
        dev = dev.masked_fill(~keep, 0.0)  # real tokens only
    tol = p.tol(y if keep is None else y[keep])
    if float(dev.max()) <= tol:
        return None
    bi, ti = first_index(dev > tol)
    return ("the output differs from the output of the call that returns weights", {
        "batch": bi, "token": ti, "deviation": float(dev[bi, ti]),
        "summary": f"token {ti} (sample {bi}): the normal call's output differs from the return-weights call's by "
                   f"{float(dev[bi, ti]):.3g} (tolerance {tol:.2g}), so the weights checked are not the ones the "
                   "output uses"}, float(dev.max()), tol)


def contexts_follow_weights(p: Probe) -> tuple[Problem | None, str, bool]:
    """``(problem, note, unverified)``: each head's context in the layer's normal call against its returned weights times its
    values, both on the check's input without padding (:meth:`~.adapters.Adapter.values_and_contexts`). A query head
    is compared with its own K/V head (``h // (h / h_kv)``) first and another only where its own does not match: which
    K/V head a query head reads is head_independence's business. Where the adapter exposes no values or contexts
    (``values`` returns None, or it or ``contexts`` raises :class:`NotExposed`) the note says so and why; where the
    contexts differ and the layer has steps between its values and W_O (``v_steps``), which may make them from
    ``w @ v`` or hide a fast path that does not, the comparison shows nothing either way: ``unverified`` is True and
    the note names the steps and the difference (the property is then not shown, never passed).

    The tolerance is 10 * rtol of the values' scale: a context is a convex combination of values, so rounding
    of the weights moves it by at most a few of their ulps times the largest value."""
    a = p.adapter
    if not a.exposes_heads:
        return None, "", False
    try:
        got = a.values_and_contexts(p.x)
        if got is None:
            return None, "; contexts not compared with the weights (the adapter exposes no values)", False
        v, c = got
    except NotExposed as exc:
        return None, f"; contexts not compared with the weights ({exc})", False
    _, w = a.run_weights(p.x)
    b, s, _ = p.x.shape
    h, h_kv = (w.shape[1], v.shape[1]) if isinstance(w, torch.Tensor) and w.dim() == 4 else (0, 0)
    if not h or h % h_kv or tuple(w.shape) != (b, h, s, s) or tuple(c.shape) != (b, h, s, v.shape[-1]) \
            or tuple(v.shape[:3]) != (b, h_kv, s):
        shapes = f"weights {tuple(getattr(w, 'shape', ()))}, values {tuple(v.shape)}, contexts {tuple(c.shape)}"
        return None, f"; contexts not compared with the weights (their shapes do not match: {shapes})", False
    w, v, c = w.double(), v.double(), c.double()
    tol = p.tol(v, 10 * p.rtol)
    g = h // h_kv
    worst, first = 0.0, None
    for i in range(h):
        own = deviation(c[:, i], w[:, i] @ v[:, i // g]).amax(-1)  # (b, s)
        best = own if float(own.max()) <= tol else \
            min((deviation(c[:, i], w[:, i] @ v[:, j]).amax(-1) for j in range(h_kv)), key=lambda d: float(d.max()))
        worst = max(worst, float(best.max()))
        if first is None and float(best.max()) > tol:
            first = (i, own)
    if first is None:
        return None, ", contexts are the weights times the values", False
    i, own = first
    bi, ti = first_index(own > tol)
    if a.v_steps:  # its own steps may make the contexts from w @ v, or hide a wrong fast path: neither shown
        return None, (f"contexts not verified: the layer has {', '.join(a.v_steps)} between its values and W_O, "
                      f"and head {i}'s context differs from w @ v by {float(own[bi, ti]):.3g}"), True
    return ("the contexts are not the returned weights times the values", {
        "head": i, "batch": bi, "token": ti, "deviation": float(own[bi, ti]),
        "summary": f"head {i}'s context at token {ti} (sample {bi}) differs from its returned weights times its "
                   f"values (w @ v) by {float(own[bi, ti]):.3g} (tolerance {tol:.2g}): the output is not made of "
                   "the weights checked"}, worst, tol), "", False
