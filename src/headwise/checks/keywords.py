"""Which of headwise's calling keywords a layer takes: those its forward names, and those it may take through
``**kwargs``.

A forward with ``**kwargs`` (a subclass or a wrapper passing them on: ``forward(self, x, **kw)``) accepts every
keyword whether or not it uses it, so its signature cannot say what it honours. Such a keyword is only a candidate
at construction, and taken once the layer is seen to honour it on the working copy, before any property runs
(:func:`confirmed`); one it refuses (Python's ``unexpected keyword argument``: a callee that does not take it) or
that changes nothing is left out and the layer is checked as one without it. That is how a forward that swallows
``causal`` is caught: it is run as it is, without the flag, and fails causality if it reads later tokens, instead of
being trusted to have masked them. Any other error it raises with the keyword keeps it: the property that uses the
keyword meets the error and reports it, as it would for a forward naming the keyword. A flag the adapter's own
code or its user set (True or False) is not a candidate (:class:`~headwise.checks.adapters.CallableAdapter`).

Shapes:
    b: batch, s: tokens, d: d_model, h: query heads.
    x: (b, s, d); keep: (b, s) bool True = real token; weights: (b, h, s, s).
"""

from __future__ import annotations

import copy
import inspect
import math
from typing import Any, Callable

import torch

__all__ = ["FLAGS", "signature_keywords", "changed", "confirmed", "ignored_note"]

# headwise's calling keywords (the candidates of a forward with **kwargs) and the adapter's flag for each
FLAGS = {"mask": "accepts_mask", "causal": "accepts_causal", "return_weights": "exposes_weights",
          "positions": "positional", "cache": "has_cache"}


def signature_keywords(fn: Callable) -> tuple[set[str], bool]:
    """The keywords ``fn`` names, and whether it also takes ``**kwargs``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return set(), False
    named = {n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return named, any(p.kind is p.VAR_KEYWORD for p in params.values())


def changed(a: Any, b: Any) -> bool:
    """Whether two results of the layer differ beyond rounding (sqrt(eps) of the output's scale: a keyword that is
    honoured moves outputs by O(1), one that is ignored by nothing at all, or by a non-deterministic kernel's ulps).
    (measure.deviation's rule for non-finite values, written here: measure imports the adapters, which import this.)"""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
        return True
    eps = torch.finfo(a.dtype).eps if a.dtype.is_floating_point else 0.0
    a, b = a.double(), b.double()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    finite = torch.isfinite(a) & torch.isfinite(b)
    scale = float(a[finite].abs().max()) if bool(finite.any()) else 1.0
    moved = ~finite | ((a - b).abs() > math.sqrt(eps) * max(scale, 1e-12))
    return bool((~same & moved).any())


# what a call with a candidate keyword came to
RAN, REFUSED, RAISED = "ran", "refused", "raised"


# Python's own complaints that a callee cannot take a keyword from a wrapper: it has no such parameter, or the
# wrapper passes that one itself (``f(x, causal=True, **kw)``)
_REFUSALS = ("unexpected keyword argument '{}'", "multiple values for keyword argument '{}'",
             "multiple values for argument '{}'", "'{}' is an invalid keyword argument")


def _refused(exc: BaseException, keyword: str) -> bool:
    return isinstance(exc, TypeError) and any(r.format(keyword) in str(exc) for r in _REFUSALS)


def _try(call: Callable[[], Any], keyword: str) -> tuple[str, Any]:
    """(RAN, the result); (REFUSED, None) when the layer refuses ``keyword``; (RAISED, None) for any other error,
    ``SystemExit`` included as the driver counts it (``KeyboardInterrupt`` stops the check): the keyword is then
    kept, and the properties meet the error on their own calls and report it."""
    try:
        return RAN, call()
    except (Exception, SystemExit) as exc:
        return (REFUSED if _refused(exc, keyword) else RAISED), None


def _taken(outcomes: tuple[str, ...], honoured: Callable[[], bool], keyword: str, ignored: set[str]) -> bool:
    """Whether ``keyword`` is kept: not where the layer refused it, yes where it raised otherwise, else where the
    calls show it honoured (``ignored`` gets the keyword when they do not)."""
    if REFUSED in outcomes:
        return False
    if RAISED in outcomes or honoured():
        return True
    ignored.add(keyword)
    return False


def confirmed(adapter: Any, x: torch.Tensor) -> Any:
    """``adapter`` with the keywords it only may take (``adapter.unconfirmed``) settled by running the layer on
    ``x``: a copy whenever there is anything to settle, so that the adapter passed in (perhaps the caller's own)
    keeps its flags. Until then such an adapter runs the layer as one without them.

    ``causal`` is taken when causal and non-causal calls differ, ``mask`` when masking the last key changes the
    output, ``return_weights`` when the call returns ``(y, weights)``, ``positions`` (a rotary layer) when reversed
    positions change the output; ``cache`` (a layer with ``new_cache``) when a prefill of one token and one decode
    step run through :meth:`decode` (a cache it ignores fails causality's decode). ``ignored_keywords`` names those
    it took without complaint and without effect."""
    guessed = set(getattr(adapter, "unconfirmed", ()))
    if not guessed:
        return adapter
    new = copy.copy(adapter)
    new.unconfirmed = frozenset()
    ignored: set[str] = set()
    fn = new.fn
    b, s, _ = x.shape
    if "causal" in guessed:
        (o_t, y_t), (o_f, y_f) = _try(lambda: fn(x, causal=True), "causal"), _try(lambda: fn(x, causal=False), "causal")
        new.accepts_causal = _taken((o_t, o_f), lambda: changed(y_t, y_f), "causal", ignored)
    if "mask" in guessed:
        keep = torch.ones(b, s, dtype=torch.bool, device=x.device)
        keep[:, -1] = False  # the last key: no query is left without a key, causal or not
        new.accepts_mask = True  # for these calls; settled below
        (o_m, y_m), (o_0, y_0) = _try(lambda: new.run(x, keep=keep), "mask"), _try(lambda: new.run(x), "mask")
        new.accepts_mask = _taken((o_m, o_0), lambda: changed(y_m, y_0), "mask", ignored)
    if "return_weights" in guessed:
        o_w, out = _try(lambda: new.run_weights(x), "return_weights")
        new.exposes_weights = _taken((o_w,), lambda: isinstance(out, (tuple, list)) and len(out) == 2
                                     and isinstance(out[1], torch.Tensor), "return_weights", ignored)
    if "positions" in guessed:
        backwards = torch.arange(s - 1, -1, -1, device=x.device)
        new.positional = True  # for these calls, as the mask above
        (o_p, y_p), (o_0, y_0) = _try(lambda: new.run(x, positions=backwards), "positions"), \
            _try(lambda: new.run(x), "positions")
        new.positional = _taken((o_p, o_0), lambda: changed(y_p, y_0), "positions", ignored)
    if "cache" in guessed:
        new.has_cache = True  # for this call: the decode causality runs, on two tokens
        o_c, _ = _try(lambda: new.decode(x[:, :2], 1), "cache")
        # whether the cache is honoured is causality's decode comparison; here only whether the layer takes it
        new.has_cache = _taken((o_c,), lambda: True, "cache", ignored)
    new.ignored_keywords = frozenset(ignored)
    return new


def ignored_note(adapter: Any, keyword: str) -> str:
    """`` (its **kwargs took keyword= and ignored it)`` where the layer did, else an empty string."""
    return f" (its **kwargs took {keyword}= and ignored it)" if keyword in getattr(adapter, "ignored_keywords", ()) \
        else ""
