"""What a trace edit does to one head at one site: parsing ``edit={key: value}`` into per-layer plans.

A plan holds, per site, a per-head scale (``"zero"``, numbers, 0-d tensors: one multiply for the layer) and
per-head functions (``"mean"``, replacement tensors, callables). :func:`apply` runs a site's plan on the
layer's tensor.

Shapes (one head's slice ``x_h`` at each site):
    q, z: (b, s_q, d_h); k, v: (b, s_kv, d_h) (the query head's own view under GQA);
    pattern: (b, s_q, s_kv).
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Callable, NamedTuple

import torch

from ..module_calls import kv_prompt

__all__ = ["SITES", "SitePlan", "parse_value", "apply", "masked_mean", "real_positions", "CachePadding",
           "UnknownPadding", "Unseen", "OtherSequence", "DeferredPadding"]

SITES = ("q", "k", "v", "pattern", "z")
_REAL_AXIS = {"q": "query", "z": "query", "k": "key", "v": "key"}  # which positions "mean" averages over


class SitePlan:
    """One site's edits on one layer: ``scale`` (a per-head factor, or None) and ``fns`` [(head, fn)]."""

    def __init__(self, n_heads: int) -> None:
        self.n_heads = n_heads
        self.scale: list[float] | None = None
        self.fns: list[tuple[int, Callable[..., torch.Tensor]]] = []
        #: The edits (their ``where``) that average over the call's positions (``"mean"``): only per-position
        #: edits keep their meaning where a call sees part of the positions (a bare layer's KVCache step).
        self.means: list[str] = []

    def add(self, head: int, factor: float | None, fn: Callable[..., torch.Tensor] | None) -> None:
        if factor is not None:
            self.scale = self.scale or [1.0] * self.n_heads
            self.scale[head] = factor
        else:
            self.fns.append((head, fn))
            if getattr(fn, "averages", None) is not None:
                self.means.append(fn.averages)  # type: ignore[union-attr]

    def __bool__(self) -> bool:
        return self.scale is not None or bool(self.fns)


def apply(plan: SitePlan, x: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    """``x`` with ``plan``'s edits, head axis 1 (per query head). Shapes: (b, h, s, n) -> (b, h, s, n)."""
    if plan.scale is not None:
        x = x * torch.tensor(plan.scale, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    if plan.fns:
        heads = list(x.unbind(1))  # h x (b, s, n)
        for i, fn in plan.fns:
            heads[i] = fn(heads[i], padding)
        x = torch.stack(heads, dim=1)
    return x


def masked_mean(x_h: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """The mean over positions (axis 1) of each row, real positions only where ``real`` says.

    Shapes: x_h (b, s, n); real (b, s) bool or None -> (b, 1, n)

    Example:
        >>> x = torch.tensor([[[1.0], [3.0], [100.0]]])
        >>> masked_mean(x, torch.tensor([[True, True, False]])).flatten().tolist()
        [2.0]
    """
    if real is None:
        return x_h.mean(dim=1, keepdim=True)
    w = real.to(x_h.dtype).unsqueeze(-1)  # (b, s, 1)
    return (x_h * w).sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp(min=1)


class UnknownPadding:
    """A model call's padding that its attention_mask does not show exactly (e.g. a 4-D mask that is not a
    causal or bidirectional padding mask, or a dict of masks). Whatever averages over real tokens ("mean",
    :meth:`LayerRecord.mean`) refuses it instead of averaging over padding."""

    def __init__(self, why: str) -> None:
        self.why = why

    def refuse(self) -> ValueError:
        return ValueError(f"'mean' averages over each row's real tokens, but {self.why}, so which positions "
                          "are real is unknown; use ('mean', reference) (a trace's mean taken on a call with a "
                          "2-D attention_mask) or a tensor of the means instead")

    def __repr__(self) -> str:
        return f"UnknownPadding({self.why!r})"


class Unseen(UnknownPadding):
    """The padding of a call whose ``attention_mask`` the trace did not see: the traced model was run past its
    own ``__call__`` (``model.forward``, ``torch.compile(model.forward)``, a submodule), which its forward
    pre-hook never sees, and no mask reached the layer where the trace could read it."""

    def refuse(self) -> ValueError:
        return ValueError(f"'mean' averages over each row's real tokens, but {self.why}, so which positions are "
                          "real is unknown; call the model itself with its mask (model(ids, attention_mask=mask), "
                          "or torch.compile(model) rather than torch.compile(model.forward)), or use "
                          "('mean', reference) or a tensor of the means instead")


class OtherSequence(UnknownPadding):
    """The keys' padding of a cross-attention call (its module given the other sequence, an encoder's states):
    their positions are that sequence's, which the model's ``attention_mask`` (its queries' tokens) does not
    describe, so a mean of k or v over them is refused."""

    def refuse(self) -> ValueError:
        return ValueError(f"'mean' of k or v averages over the real keys, but {self.why}, so which of them are real is "
                          "unknown; pass a tensor of the means (average the keys over the encoder's real tokens "
                          "yourself), or edit by a callable")


class DeferredPadding:
    """A call's padding kept as what was seen (a mask) and read into real tokens only when a mean needs them
    (:meth:`resolve`), so compiled code that never takes a mean never computes it."""

    def resolve(self) -> "torch.Tensor | CachePadding | UnknownPadding | None":  # pragma: no cover - overridden
        raise NotImplementedError


class CachePadding(NamedTuple):
    """The real tokens of a call read off a 4-D mask: ``tokens`` (b, S) as a 2-D mask holds them (column j is
    position j, the call's queries its last columns); the mask let no row read a key slot past S (a
    pre-allocated cache's empty ones), so those are not real."""

    tokens: torch.Tensor


def real_positions(padding: torch.Tensor | CachePadding | UnknownPadding | None, x_h: torch.Tensor, where: str,
                   site: str = "z") -> torch.Tensor | None:
    """The (b, s) real-token mask for ``x_h``'s positions from the model call's (b, s_total) one, whose column
    j is position j: queries and keys are its last s columns (a decoding step's queries are the newest). Keys
    past a 2-D mask (a static cache's empty slots, or cross-attention keys from another sequence) cannot be
    told apart, so they are refused; past a 4-D mask's tokens (:class:`CachePadding`) they are not real."""
    if isinstance(padding, DeferredPadding):
        padding = padding.resolve()
    if padding is None:
        return None
    if isinstance(padding, UnknownPadding):
        raise ValueError(f"{where}: {padding.refuse()}")
    b, s = x_h.shape[:2]
    if isinstance(padding, CachePadding):
        padding = padding.tokens
        if _REAL_AXIS[site] == "key" and padding.shape[0] == b and padding.shape[1] < s:
            return torch.nn.functional.pad(padding, (0, s - padding.shape[1]), value=False)
    if padding.shape[0] != b or padding.shape[1] < s:
        said = f"{where}: 'mean' reads the model's attention_mask (b, s) = {tuple(padding.shape)}, which does not " \
            f"cover this call's batch {b} and {s} positions"
        prefix = _prefix_tuning() if _REAL_AXIS[site] == "key" and padding.shape[0] == b else None
        if prefix is not None:
            name, n = prefix
            raise ValueError(f"{said}: the keys include the {n} virtual tokens of {name}'s prefix tuning, which "
                             "PEFT puts before the prompt's keys and leaves out of the mask the model was given, so "
                             "which keys a mean over positions counts is unknown; trace peft_model.get_base_model() "
                             "instead (it is given PEFT's own mask, which marks the prefix's keys real: the mean "
                             "then counts them), or pass a tensor of the means")
        more = " (keys beyond the mask: a static cache's empty slots, or cross-attention keys, are not told " \
            "apart by a 2-D mask; pass the 4-D mask, or use ('mean', reference))" if _REAL_AXIS[site] == "key" else ""
        raise ValueError(f"{said}{more}")
    return padding[:, padding.shape[1] - s:]


def _prefix_tuning() -> tuple[str, int] | None:
    """``(class name, virtual tokens)`` of a PEFT prefix-tuned model whose forward is running this call, or None.

    The padding a trace reads is the traced call's own mask, and the model it came from is not at hand here:
    whether keys past that mask are a PEFT prefix is known only to the PEFT forward on the call stack, so a
    refusal (never a call that succeeds) asks the stack."""
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and type(owner).__module__.split(".")[0] == "peft":
            try:
                config = owner.active_peft_config
            except Exception:  # noqa: BLE001 - several active adapters, or not a PeftModel: no prefix to name
                config = None
            if kv_prompt(config):
                return type(owner).__name__, int(getattr(config, "num_virtual_tokens", 0))
        frame = frame.f_back
    return None


def _number(value: Any, where: str) -> float:
    try:
        factor = float(value)
    except OverflowError:
        raise ValueError(f"{where}: a scale must be a finite number, got an int of {len(str(value))} digits") from None
    if factor != factor or factor in (float("inf"), float("-inf")):
        raise ValueError(f"{where}: a scale must be a finite number, got {value!r}")
    return factor


def parse_value(value: Any, site: str, where: str, width: int | None, li: int, head: int,
                reference: Callable[[], torch.Tensor] | None = None) -> tuple[float | None, Callable | None]:
    """``(factor, None)`` for a scale, ``(None, fn(x_h, padding) -> x_h)`` otherwise.

    ``width`` is the site's last axis (d_h; for ``pattern`` None: any s_kv). ``reference()`` gives the
    ``("mean", trace)`` replacement."""
    if isinstance(value, str):
        if value == "zero":
            return 0.0, None
        if value == "mean":
            if site not in _REAL_AXIS:
                raise ValueError(f"{where}: 'mean' averages over positions: it applies to q, k, v and z, not {site}")
            def mean(x_h: torch.Tensor, padding: Any) -> torch.Tensor:
                return masked_mean(x_h, real_positions(padding, x_h, where, site)).expand_as(x_h)
            mean.averages = where  # type: ignore[attr-defined]  # SitePlan.means
            return None, mean
        raise ValueError(f"{where}: unknown edit {value!r}; use 'zero', 'mean', ('mean', reference_trace), a "
                         "number, a tensor or a callable (x_h, layer, head) -> x_h")
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "mean":
        if reference is None:
            raise ValueError(f"{where}: ('mean', reference) averages over positions: q, k, v and z only")
        return None, replacement(reference(), where, width)
    if isinstance(value, bool):
        raise TypeError(f"{where}: expected 'zero', 'mean', a number, a tensor or a callable, got a bool")
    if isinstance(value, numbers.Real):
        return _number(value, where), None
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            raise ValueError(f"{where}: the edit tensor is on the meta device (it holds no values)")
        if value.dim() == 0:
            if not (value.is_floating_point() or value.dtype in (torch.int8, torch.int16, torch.int32, torch.int64,
                                                                 torch.uint8)):
                raise TypeError(f"{where}: a 0-d tensor is a scale and must be real, got {value.dtype}")
            return _number(value.item(), where), None
        return None, replacement(value, where, width)
    if callable(value):
        def call(x_h: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
            out = value(x_h, li, head)
            if not isinstance(out, torch.Tensor) or out.shape != x_h.shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"{where}: the callable must return a tensor of the slice's shape "
                                 f"{tuple(x_h.shape)}, got {got}")
            if out.dtype != x_h.dtype or out.device != x_h.device:
                # never cast silently: a half-precision edit of a float32 layer would lose what it meant
                raise TypeError(f"{where}: the callable must return a tensor of the slice's dtype and device "
                                f"({x_h.dtype} on {x_h.device}), got {out.dtype} on {out.device}")
            return out
        return None, call
    raise TypeError(f"{where}: expected 'zero', 'mean', ('mean', trace), a number, a tensor or a callable, "
                    f"got {type(value).__name__}")


def replacement(t: torch.Tensor, where: str, width: int | None) -> Callable[..., torch.Tensor]:
    """An edit that puts ``t`` in place of the head's slice (broadcast over the leading axes)."""
    if not t.is_floating_point() or t.dim() > 3 or (width is not None and t.shape[-1] != width):
        expected = f"(n,), (s, n) or (b, s, n) with n = {width}" if width is not None else "(n,), (s, n) or (b, s, n)"
        raise ValueError(f"{where}: a replacement is a floating tensor {expected}, got {t.dtype} {tuple(t.shape)}")
    if not torch.isfinite(t).all():
        raise ValueError(f"{where}: the replacement holds inf or NaN")

    def replace(x_h: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        # Checked on the sizes (plain ints), never by catching a failed broadcast: compiled code raises its own
        # error type for that.
        # The last axis must match (for pattern it is this call's s_kv, unknown before the call): spreading one
        # value over every key is a different edit from the one the shape describes. Leading axes may be 1.
        fits = (t.dim() <= x_h.dim() and t.shape[-1] == x_h.shape[-1]
                and all(a == 1 or a == n for a, n in zip(reversed(t.shape[:-1]), reversed(x_h.shape[:-1]))))
        if not fits:
            raise ValueError(f"{where}: replacement {tuple(t.shape)} does not broadcast to this call's "
                             f"{tuple(x_h.shape)}: expected (n,), (s, n) or (b, s, n) with n = {x_h.shape[-1]} and "
                             f"s, b equal to the slice's or 1")
        return t.to(device=x_h.device, dtype=x_h.dtype).expand_as(x_h)
    return replace
