"""Which of headwise's calling keywords a layer takes: those its forward names, and those it may take through
``**kwargs``.

A forward with ``**kwargs`` (a subclass or a wrapper passing them on: ``forward(self, x, **kw)``) accepts every
keyword whether or not it uses it, so its signature cannot say what it honours. Such a keyword is only a candidate
at construction, and taken once the layer is seen to honour it on the working copy, before any property runs
(:func:`confirmed`); one it raises on or that changes nothing is left out and the layer is checked as one without
it. That is how a forward that swallows ``causal`` is caught: it is run as it is, without the flag, and fails
causality if it reads later tokens, instead of being trusted to have masked them.

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

__all__ = ["CONVENTION", "signature_keywords", "changed", "confirmed", "ignored_note"]

# headwise's calling convention: the candidates of a forward with **kwargs
CONVENTION = frozenset({"mask", "causal", "return_weights", "positions", "cache"})
# the adapter's flag that says it uses each keyword
_FLAGS = {"mask": "accepts_mask", "causal": "accepts_causal", "return_weights": "exposes_weights",
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
    honoured moves outputs by O(1), one that is ignored by nothing at all, or by a non-deterministic kernel's ulps)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
        return True
    eps = torch.finfo(a.dtype).eps if a.dtype.is_floating_point else 0.0
    a, b = a.double(), b.double()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    finite = torch.isfinite(a) & torch.isfinite(b)
    scale = float(a[finite].abs().max()) if bool(finite.any()) else 1.0
    moved = ~finite | ((a - b).abs() > math.sqrt(eps) * max(scale, 1e-12))
    return bool((~same & moved).any())


def _try(call: Callable[[], Any]) -> tuple[bool, Any]:
    """(True, the result), or (False, None) when the layer raises: a ``TypeError`` is a wrapper passing ``**kwargs``
    on to a callee that does not take the keyword; any other error (``SystemExit`` too) leaves the keyword
    unconfirmed, and the properties meet the layer's errors on their own calls and report them."""
    try:
        return True, call()
    except (Exception, SystemExit):
        return False, None


def confirmed(adapter: Any, x: torch.Tensor) -> Any:
    """``adapter`` with the keywords it only may take (``adapter.unconfirmed``) settled by running the layer on
    ``x``: a copy whenever there is anything to settle, so that the adapter passed in (perhaps the caller's own)
    keeps its flags. Until then such an adapter runs the layer as one without them.

    ``causal`` is taken when causal and non-causal calls differ, ``mask`` when masking the last key changes the
    output, ``return_weights`` when the call returns ``(y, weights)``, ``positions`` (a rotary layer) when reversed
    positions change the output; ``cache`` with the layer's ``new_cache`` (a cache it ignores fails causality's
    decode). ``ignored_keywords`` names those it took without complaint and without effect."""
    # a flag already set (by a subclass of the adapter, say) is the adapter's own word and stays
    guessed = {k for k in getattr(adapter, "unconfirmed", ()) if not getattr(adapter, _FLAGS[k], False)}
    if not guessed:
        return adapter
    new = copy.copy(adapter)
    new.unconfirmed = frozenset()
    ignored = set()
    fn = new.fn
    b, s, _ = x.shape
    if "causal" in guessed:
        ok_t, y_t = _try(lambda: fn(x, causal=True))
        ok_f, y_f = _try(lambda: fn(x, causal=False))
        new.accepts_causal = ok_t and ok_f and changed(y_t, y_f)
        if ok_t and ok_f and not new.accepts_causal:
            ignored.add("causal")
    if "mask" in guessed:
        keep = torch.ones(b, s, dtype=torch.bool, device=x.device)
        keep[:, -1] = False  # the last key: no query is left without a key, causal or not
        new.accepts_mask = True  # for this call; kept only if the mask changed something
        ok, y_m = _try(lambda: new.run(x, keep=keep))
        ok_0, y_0 = _try(lambda: new.run(x))
        new.accepts_mask = ok and ok_0 and changed(y_m, y_0)
        if ok and ok_0 and not new.accepts_mask:
            ignored.add("mask")
    if "return_weights" in guessed:
        ok, out = _try(lambda: new.run_weights(x))
        new.exposes_weights = ok and isinstance(out, (tuple, list)) and len(out) == 2 \
            and isinstance(out[1], torch.Tensor)
        if ok and not new.exposes_weights:
            ignored.add("return_weights")
    if "positions" in guessed:
        backwards = torch.arange(s - 1, -1, -1, device=x.device)
        new.positional = True  # for this call, as the mask above
        ok, y_p = _try(lambda: new.run(x, positions=backwards))
        ok_0, y_0 = _try(lambda: new.run(x))
        new.positional = ok and ok_0 and changed(y_p, y_0)
        if ok and ok_0 and not new.positional:
            ignored.add("positions")
    if "cache" in guessed:
        new.has_cache = True
    new.ignored_keywords = frozenset(ignored)
    return new


def ignored_note(adapter: Any, keyword: str) -> str:
    """`` (its **kwargs took keyword= and ignored it)`` where the layer did, else an empty string."""
    return f" (its **kwargs took {keyword}= and ignored it)" if keyword in getattr(adapter, "ignored_keywords", ()) \
        else ""
