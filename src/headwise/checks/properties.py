"""The seven properties every attention layer must satisfy, one function each.

Each takes a :class:`~headwise.checks.measure.Probe` (the adapter, seeded inputs and tolerances) and returns a
:class:`~headwise.checks.report.PropertyResult`. Deviations are measured as max absolute differences and
judged against a tolerance relative to the output's scale (``rtol * max|y|``), in float64 when the layer
can run in it. Counterexamples are the smallest indices that show a violation.

Shapes:
    b: batch, s: tokens, d: d_model, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .keywords import ignored_note
from .measure import DTYPE_RTOL, Probe, deviation, first_index, nonfinite, skip
from .report import FAIL, PASS, PropertyResult
from .softmax_scale import SOFTMAX_FLOOR, allowed_keys, check_scale
from .weights_used import Problem, contexts_follow_weights, outputs_follow_weights

__all__ = ["Probe", "PROPERTIES", "permutation_equivariance", "batch_independence", "causality",
           "padding_invariance", "softmax_sanity", "head_independence", "dtype_stability"]

# -- 1 ------------------------------------------------------------------------------------------------------
def _permuted_prefix(p: Probe, name: str) -> PropertyResult:
    """The causal form: output t reads keys 0..t as a set, so permuting tokens 0..t-1 (with their positions, for
    rotary layers: each key keeps its position, so every score is unchanged) must leave output t as it was.
    Under a sliding window only outputs whose window holds the whole prefix are judged."""
    a = p.adapter
    s = p.x.shape[1]
    reach = s if a.window is None else min(s, a.window)  # outputs before `reach` read every token before them
    t = reach - 1
    if t < 2:
        return skip(name, f"the layer is causal only and a prefix of {t} token(s) has no order to permute "
                          f"(seq_len={s}{'' if a.window is None else f', sliding window {a.window}'}); "
                          "use seq_len >= 3")
    if not a.positional and getattr(getattr(a, "module", None), "rotary", None) is not None:
        return skip(name, "the layer has rotary positions the check cannot permute along with the tokens")
    perm = torch.randperm(t, generator=p.generator)
    if torch.equal(perm, torch.arange(t)):  # the identity would prove nothing
        perm = torch.roll(perm, 1)
    order = torch.cat([perm, torch.arange(t, s)]).to(p.x.device)
    kw = {"causal": True} if a.accepts_causal else {}
    y = a.run(p.x, **kw)
    if (bad := nonfinite(name, y)) is not None:
        return bad
    y_perm = a.run(p.x[:, order], positions=order, **kw) if a.positional else a.run(p.x[:, order], **kw)
    dev = deviation(y_perm[:, t:reach], y[:, t:reach]).amax(-1)  # (b, reach - t)
    tol = p.tol(y)
    worst = float(dev.max())
    note = f"causal: permuting tokens 0..{t - 1} by {perm.tolist()} left output {t} unchanged" \
        + (" (positions moved along)" if a.positional else "")
    if worst <= tol:
        return PropertyResult(name, PASS, note, None, worst, tol)
    bi, ti = first_index(dev > tol)
    return PropertyResult(name, FAIL, "a causal output depends on the order of the tokens before it", {
        "permutation": perm.tolist(), "batch": bi, "token": t + ti, "deviation": float(dev[bi, ti]),
        "summary": f"permuting tokens 0..{t - 1} by {perm.tolist()} changed the output at token {t + ti} "
                   f"(sample {bi}, max |diff| {float(dev[bi, ti]):.3g}); attention reads its keys as a set"},
        worst, tol)


def permutation_equivariance(p: Probe) -> PropertyResult:
    """Permuting tokens (without positions) permutes the outputs: ``f(x[:, perm]) == f(x)[:, perm]``.
    Catches token/head flattening bugs. Layers with positions (rotary) get the positions permuted too.
    A causal layer is also run in its causal form (a causal-only layer only in it): permuting the tokens before
    output t leaves output t unchanged."""
    name = "permutation_equivariance"
    a = p.adapter
    if a.position_bias(p.x.shape[1]) is not None:
        return skip(name, "the layer adds a relative position bias to its scores (T5's), which the check cannot "
                          "permute along with the tokens")
    if a.claims_causal and not a.accepts_causal:
        return _permuted_prefix(p, name)
    s = p.x.shape[1]
    perm = torch.randperm(s, generator=p.generator)
    if torch.equal(perm, torch.arange(s)):  # the identity would prove nothing
        perm = torch.roll(perm, 1)
    kw = {"causal": False} if a.accepts_causal else {}
    y = a.run(p.x, **kw)
    if (bad := nonfinite(name, y)) is not None:
        return bad
    positions = perm.to(p.x.device) if a.positional else None
    y_perm = a.run(p.x[:, perm], positions=positions, **kw) if positions is not None else a.run(p.x[:, perm], **kw)
    dev = deviation(y_perm, y[:, perm]).amax(-1)  # (b, s)
    tol = p.tol(y)
    worst = float(dev.max())
    if worst > tol:
        bi, ti = first_index(dev > tol)
        return PropertyResult(name, FAIL, "outputs do not follow their tokens", {
            "permutation": perm.tolist(), "batch": bi, "token": int(perm[ti]), "moved_to": ti,
            "deviation": float(dev[bi, ti]),
            "summary": f"token {int(perm[ti])} of sample {bi}, moved to position {ti}, got a different output "
                       f"(max |diff| {float(dev[bi, ti]):.3g})"}, worst, tol)
    note = f"tokens permuted by {perm.tolist()}" + (" with their positions" if positions is not None else "")
    if a.claims_causal:  # the layer's own (causal) function must read its prefix as a set as well
        causal = _permuted_prefix(p, name)
        if causal.failed:
            return causal
        if causal.passed:
            note += f"; {causal.detail}"
            worst, tol = max(worst, causal.deviation or 0.0), max(tol, causal.tolerance or 0.0)
    return PropertyResult(name, PASS, note, None, worst, tol)


# -- 2 ------------------------------------------------------------------------------------------------------
def _leak_source(p: Probe, y: torch.Tensor, i: int, alone: torch.Tensor, tol: float) -> PropertyResult:
    """Sample ``i`` differs from itself run alone (``alone``: (s,)): name the sample whose change moves it, halving
    the suspects (about 2 log2 b runs, on failure only), or say that none does (its output follows the batch size)."""
    b, s, d = p.x.shape

    def moved(samples: list[int]) -> torch.Tensor:  # (s,) how far sample i moves when `samples` are redrawn
        x2 = p.x.clone()
        x2[samples] = p.randn(len(samples), s, d)
        return deviation(p.adapter.run(x2)[i], y[i]).amax(-1)

    suspects = [j for j in range(b) if j != i]
    dev = moved(suspects)
    while len(suspects) > 1 and float(dev.max()) > tol:  # keep a half whose change alone moves sample i
        halves = (suspects[:len(suspects) // 2], suspects[len(suspects) // 2:])
        found = next(((half, dv) for half in halves if float((dv := moved(half)).max()) > tol), None)
        if found is None:  # only the halves together move it: they are named together
            break
        suspects, dev = found
    if float(dev.max()) <= tol:
        ti = first_index(alone > tol)[0]
        return PropertyResult("batch_independence", FAIL, "a sample's output depends on the batch size", {
            "sample": i, "token": ti, "deviation": float(alone[ti]), "summary": f"sample {i} run alone differs from "
            f"its output in the batch of {b} at token {ti} (max |diff| {float(alone[ti]):.3g}); changing the other "
            "samples moves nothing"}, float(alone.max()), tol)
    ti = first_index(dev > tol)[0]
    one = len(suspects) == 1
    which = f"sample {suspects[0]}" if one else f"samples {suspects} together"
    return PropertyResult("batch_independence", FAIL, "samples leak into each other", {
        **({"changed_sample": suspects[0]} if one else {"changed_samples": suspects}),
        "sample": i, "token": ti, "deviation": float(dev[ti]),
        "summary": f"changing {which} changed sample {i} at token {ti} (max |diff| {float(dev[ti]):.3g})"},
        float(dev.max()), tol)


def batch_independence(p: Probe) -> PropertyResult:
    """No sample's output depends on the rest of the batch: each equals the sample run alone (batch 1) within the
    tolerance (kernels may round a batch of 1 differently). b + 1 runs, b samples' work each way, and a leak from
    any sample (a batch-1 buffer broadcast over the batch reads one fixed one) moves another sample's output."""
    name = "batch_independence"
    b, s, d = p.x.shape
    if b < 2:
        return skip(name, "needs batch >= 2")
    y = p.adapter.run(p.x)
    if (bad := nonfinite(name, y)) is not None:
        return bad
    tol, worst = p.tol(y), 0.0
    for i in range(b):
        alone = deviation(p.adapter.run(p.x[i:i + 1])[0], y[i]).amax(-1)  # (s,)
        worst = max(worst, float(alone.max()))
        if worst > tol:
            return _leak_source(p, y, i, alone, tol)
    return PropertyResult(name, PASS, f"each of the {b} samples run alone gave its output in the batch", None,
                          worst, tol)


# -- 3 ------------------------------------------------------------------------------------------------------
def causality(p: Probe) -> PropertyResult:
    """For a layer that claims causality: changing token t never changes outputs before t (nor, under a
    sliding window w, outputs at t + w or later: a query reads nothing more than w - 1 back); and, when the
    layer has a KV-cache path, prefill-then-decode equals the full causal pass."""
    name = "causality"
    a = p.adapter
    if not a.claims_causal:
        return skip(name, "the layer does not claim causality (check it with causal=True)")
    b, s, d = p.x.shape
    y = a.run(p.x)
    if (bad := nonfinite(name, y)) is not None:
        return bad
    tol = p.tol(y)
    worst = 0.0
    for t in range(1, s):
        x2 = p.x.clone()
        x2[:, t] = p.randn(b, d)
        y2 = a.run(x2)
        dev = deviation(y2[:, :t], y[:, :t]).amax(-1)  # (b, t)
        worst = max(worst, float(dev.max()))
        if a.window is not None and t + a.window < s:  # nor outputs w or more tokens after t
            far = deviation(y2[:, t + a.window:], y[:, t + a.window:]).amax(-1)  # (b, s - t - w)
            worst = max(worst, float(far.max()))
            if float(far.max()) > tol:
                bi, pos = first_index(far > tol)
                return PropertyResult(name, FAIL, f"an output reads past its sliding window of {a.window}", {
                    "changed_token": t, "batch": bi, "output_token": pos + t + a.window, "window": a.window,
                    "deviation": float(far[bi, pos]), "summary": f"changing token {t} changed the output at "
                    f"token {pos + t + a.window} (sample {bi}), outside the window"}, float(far.max()), tol)
        if float(dev.max()) > tol:
            bi, pos = first_index(dev > tol)
            return PropertyResult(name, FAIL, "an output reads a later token", {
                "changed_token": t, "batch": bi, "output_token": pos, "deviation": float(dev[bi, pos]),
                "summary": f"changing token {t} changed the output at token {pos} (sample {bi}, "
                           f"max |diff| {float(dev[bi, pos]):.3g}){ignored_note(a, 'causal')}"}, float(dev.max()), tol)
    note = f"changed each token 1..{s - 1}" + ("" if a.window is None else f" (sliding window {a.window})")
    if a.has_cache:
        prefill = s // 2
        y_dec = a.decode(p.x, prefill)
        dev = deviation(y_dec, y).amax(-1)  # (b, s)
        worst = max(worst, float(dev.max()))
        if float(dev.max()) > tol:
            bi, pos = first_index(dev > tol)
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
        return skip(name, "the layer takes no padding mask" + ignored_note(a, "mask"))
    y = a.run(p.x, keep=p.keep)
    real = p.keep
    if (bad := nonfinite(name, y[real])) is not None:
        idx = first_index(~torch.isfinite(y).all(-1) & real)
        return PropertyResult(name, FAIL, bad.detail, {"batch": idx[0], "token": idx[1], "summary":
                              f"non-finite output at real token {idx[1]} of sample {idx[0]}"}, math.inf, 0.0)
    x2 = torch.where(p.keep[..., None], p.x, p.randn(*p.x.shape))
    y2 = a.run(x2, keep=p.keep)
    dev = deviation(y2, y).amax(-1).masked_fill(~real, 0.0)  # (b, s), real tokens only
    tol = p.tol(y[real])
    worst = float(dev.max())
    if worst <= tol:
        return PropertyResult(name, PASS, f"real tokens per sample {p.keep.sum(-1).tolist()} (right and left padding)",
                              None, worst, tol)
    bi, ti = first_index(dev > tol)
    whose = f"sample {bi}" if not p.keep[bi].all() else f"other samples (sample {bi} has none: a leak across the batch)"
    return PropertyResult(name, FAIL, "padded tokens leak into real ones", {
        "batch": bi, "token": ti, "deviation": float(dev[bi, ti]), "keep": p.keep[bi].int().tolist(),
        "summary": f"changing padded tokens of {whose} changed real token {ti} of sample {bi} "
                   f"(max |diff| {float(dev[bi, ti]):.3g})"}, worst, tol)


# -- 5 ------------------------------------------------------------------------------------------------------
def softmax_sanity(p: Probe) -> PropertyResult:
    """Where weights are exposed: each row sums to 1, masked entries are exactly 0, the scores are scaled by
    1/sqrt(d_head) (the scale is fitted from the weights against the head's q . k, :mod:`.softmax_scale`), and
    the output is made of those weights (:mod:`.weights_used`): the layer's normal output is the output of the call
    that returned them, and, where heads are exposed, each head's context is its weights times its values.
    A failure reports the measure that failed, against its own limit. Where the scale's fit can neither pass nor
    fail (q and k rebuilt without the layer's own steps, ``qk_inferred``) the property is skipped saying why, with
    what did hold."""
    name = "softmax_sanity"
    a = p.adapter
    if not a.exposes_weights:
        return skip(name, "the layer exposes no attention weights" + ignored_note(a, "return_weights"))
    keep = p.keep if a.accepts_mask else None
    y_w, w = a.run_weights(p.x, keep=keep)
    b, s, d = p.x.shape
    if w is None or w.dim() != 4 or tuple(w.shape[-2:]) != (s, s) or w.shape[0] != b:
        got = None if w is None else tuple(w.shape)
        return skip(name, f"weights of shape {got} are not per head (b, h, s, s)")
    # weights below the smallest normal number of the dtype they came in (float16: 6.1e-5) have lost precision
    floor = max(SOFTMAX_FLOOR, torch.finfo(w.dtype).tiny if w.dtype.is_floating_point else 0.0)
    eps = max([torch.finfo(t).eps for t in (w.dtype, a.precision, p.computed) if t is not None and t.is_floating_point])
    w = w.double()
    allowed = allowed_keys(a, b, s, keep, w.device).expand_as(w)
    # A query that may read no key at all (a left-padded query under a causal mask) has no defined
    # softmax (zeros in headwise, NaN in torch): such rows are not judged.
    rows = allowed.any(-1)  # (b, h, s)
    w = w.masked_fill(~rows[..., None], 0.0)
    tol = 10 * p.rtol
    problems: list[Problem] = []
    sums = w.sum(-1)  # (b, h, s); with sinks a row may give part of its weight to no key: sum in (0, 1]
    row_err = ((sums - 1).clamp_min(0) + (-sums).clamp_min(0) if a.sinks else (sums - 1).abs()).masked_fill(~rows, 0.0)
    if not torch.isfinite(w).all():
        idx = first_index(~torch.isfinite(w))
        problems.append(("weights are not finite", {"index": list(idx), "summary":
                         f"non-finite weight at (batch, head, query, key) = {idx}"}, math.inf, tol))
    elif float(row_err.max()) > tol:
        bi, hi, qi = first_index(row_err > tol)
        total = float(w[bi, hi, qi].sum())
        problems.append(("rows do not sum to 1", {"batch": bi, "head": hi, "query": qi, "row_sum": total,
                         "summary": f"weights of head {hi}, query {qi} (sample {bi}) sum to {total:.12g}, not "
                         f"{'at most 1' if a.sinks else '1'} (off by {float(row_err[bi, hi, qi]):.3g}, tolerance "
                         f"{tol:.2g})"}, float(row_err.max()), tol))
    leaked = (w != 0) & ~allowed
    if leaked.any():
        bi, hi, qi, ki = first_index(leaked)
        what = "a future key" if a.claims_causal and ki > qi else "a padded key"
        # masked entries must be exactly 0: the measure is the largest weight on a masked key, its limit 0
        problems.append(("masked entries are not 0", {"batch": bi, "head": hi, "query": qi, "key": ki,
                         "weight": float(w[bi, hi, qi, ki]), "summary": f"head {hi}, query {qi} gives weight "
                         f"{float(w[bi, hi, qi, ki]):.3g} to {what} {ki} (sample {bi})"},
                         float(w.abs().masked_fill(~leaked, 0.0).max()), 0.0))
    if (mismatch := outputs_follow_weights(p, y_w, keep)) is not None:
        problems.append(mismatch)
    used, used_note, contexts_unverified = contexts_follow_weights(p)
    if used is not None:
        problems.append(used)
    scale_note, unverified = "scale not checked (the layer exposes no queries/keys)", False
    if not problems:
        scale_problem, scale_note, unverified = check_scale(a, w, p.x, allowed & rows[..., None],
                                                            lambda: p.randn(b, s, d), p.rtol, floor, eps)
        if scale_problem is not None:
            problems.append(scale_problem)
    if problems:  # the first problem's measure and limit, as its counterexample tells it
        _, cex, worst, limit = problems[0]
        return PropertyResult(name, FAIL, "; ".join(pr[0] for pr in problems), cex, worst, limit)
    rows_note = "rows sum to at most 1 (sinks take the rest)" if a.sinks else "rows sum to 1"
    same = ", outputs match the weights path" if isinstance(y_w, torch.Tensor) else ""
    if contexts_unverified:  # the contexts could neither pass nor fail: the property is not shown
        return skip(name, f"{used_note}; {rows_note}, masked entries exactly 0{same}; {scale_note}")
    if unverified:  # the scale part could neither pass nor fail: the property is not shown, whatever else held
        return skip(name, f"{scale_note}; {rows_note}, masked entries exactly 0{same}{used_note}")
    return PropertyResult(name, PASS, f"{rows_note}, masked entries exactly 0{same}{used_note}; {scale_note}", None,
                          float(row_err.max()), tol)


# -- 6 ------------------------------------------------------------------------------------------------------
def head_independence(p: Probe) -> PropertyResult:
    """Where heads are exposed: perturbing query head h's W_Q changes only head h's context; perturbing
    K/V head g's W_K or W_V changes only the query heads of group g (``h // (n_heads / n_kv_heads)``).
    The only place heads may mix is W_O, after the contexts."""
    name = "head_independence"
    a = p.adapter
    if not a.exposes_heads:
        return skip(name, a.no_heads_reason or "the layer exposes no heads (q/k/v projections and W_O)")
    h, h_kv = a.n_heads, a.n_kv_heads
    if not h or not h_kv or h % h_kv:
        return skip(name, f"n_heads={h}, n_kv_heads={h_kv} do not form groups")
    g = h // h_kv
    with torch.no_grad():
        c0 = a.contexts(p.x)  # (b, h, s, d_h)
        if (bad := nonfinite(name, c0)) is not None:
            return bad
        tol = p.tol(c0)
        worst_other = 0.0
        moved = 0  # perturbations that changed some context: with none, nothing was shown
        for which, count in (("q", h), ("k", h_kv), ("v", h_kv)):
            for i in range(count):
                with a.perturbed(which, i, p.generator):
                    c1 = a.contexts(p.x)
                dev = deviation(c1, c0).flatten(2).amax(-1).amax(0)  # (h,)
                changed = [j for j in range(h) if float(dev[j]) > tol]
                expected = [i] if which == "q" else list(range(i * g, (i + 1) * g))
                others = [j for j in range(h) if j not in expected]
                if others:
                    worst_other = max(worst_other, float(dev[others].max()))
                moved += bool(changed)
                # a head of the group may legitimately stay put under a K change (a zeroed W_Q ignores its keys);
                # a Q or V change must move exactly the heads that read it, and nothing outside them
                if not set(changed) <= set(expected) or (which != "k" and set(changed) != set(expected)):
                    kind = f"W_{which.upper()} of {'query' if which == 'q' else 'K/V'} head {i}"
                    return PropertyResult(name, FAIL, "heads are not independent before W_O", {
                        "perturbed": f"W_{which.upper()}", "head": i, "changed_heads": changed,
                        "expected_heads": expected,
                        "summary": f"perturbing {kind} changed the contexts of heads {changed}, expected "
                                   f"{expected}{' at most' if which == 'k' else ''}"}, worst_other, tol)
    if not moved:
        return skip(name, "no perturbation of W_Q, W_K or W_V changed any head's context: independence not shown")
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
        return skip(name, f"the layer does not run in float64 ({type(exc).__name__}: {str(exc)[:80]})")
    y32 = a32.run(x64.float(), keep=keep)
    if y32.dtype != torch.float32 or y64.dtype != torch.float64:
        return PropertyResult(name, FAIL, "the output dtype does not follow the input dtype", {
            "summary": f"float32 input gave {y32.dtype}, float64 input gave {y64.dtype}"}, None, None)
    dev = deviation(y32, y64).amax(-1)  # (b, s)
    if keep is not None:
        dev = dev.masked_fill(~keep, 0.0)  # real tokens only
    tol = p.tol(y64[keep] if keep is not None else y64, DTYPE_RTOL)
    worst = float(dev.max())
    if worst <= tol:
        return PropertyResult(name, PASS, "float32 vs float64 on the same weights", None, worst, tol)
    bi, ti = first_index(dev > tol)
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
