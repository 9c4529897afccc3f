"""Every head of a real model, captured and edited inside its own forward: ``headwise.trace``.

``with headwise.trace(model, capture=("z", "result"), edit={(3, 5): "zero"}) as t: model(x)`` runs the
model's own forward (its masks, norms, rotary, cache) while every :class:`~headwise.MultiHeadAttention` in it
reports its heads through the layer's tracer seam (``MultiHeadAttention.tracer``): what ``capture`` names is
kept per layer, and ``edit`` rewrites chosen heads' contexts before W_O. Edits never touch a weight and end
with the ``with`` block; a single head of a GQA group is edited alone (its group's K/V are shared, its
context is its own).

What can be captured (per call of the layer; ``t[i].calls`` keeps every call, e.g. each decoding step):

* ``"q"`` (b, h, s_q, d_h) after rotary; ``"k"``, ``"v"`` (b, h_kv, s, d_h): in a bare layer's forward the
  call's new keys/values (before any cache write); in a patched Hugging Face module what the call attends
  over (HF's cache included).
* ``"pattern"`` (b, h, s_q, s_kv): every head's probabilities. Only this capture materialises them: the
  layers that capture it run the eager path (``Trace.materializes_probabilities`` names them).
* ``"z"`` (b, s_q, h, d_h): each head's context, after the edits (what W_O reads).
* ``"result"`` (b, s_q, h, d): each head's write into the residual stream, ``z_h @ W_O^h``, computed as h
  GEMMs (never a (b, s, h, d_h, d) broadcast); summed over heads plus W_O's bias it is the layer's output.

``z`` and ``result`` keep the fused SDPA path: memory is the captured tensors, O(s) per head.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width (d_model), d_h: head width (d_head).

Example:
    >>> import torch, headwise
    >>> attn = headwise.MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2)
    >>> x = torch.randn(2, 5, 16)
    >>> with headwise.trace(attn, capture=("z", "result"), edit={(0, 1): "zero"}) as t:
    ...     y = attn(x)
    >>> t[0].z.shape, t[0].result.shape, bool(t[0].z[:, :, 1].eq(0).all())
    (torch.Size([2, 5, 4, 4]), torch.Size([2, 5, 4, 16]), True)
    >>> torch.testing.assert_close(t[0].result.sum(2) + attn.out_proj.bias, y)
    >>> attn.tracer is None                                  # the edit ended with the block
    True
"""

from __future__ import annotations

import math
import sys
import types
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from .attention import MultiHeadAttention

__all__ = ["trace", "Trace", "LayerRecord", "find_layers", "head_results", "CAPTURABLE"]

CAPTURABLE = ("q", "k", "v", "pattern", "z", "result")
_BY_POSITION = {"q": 2, "z": 1, "result": 1}  # the query-position axis: several calls concatenate along it


def find_layers(module: nn.Module) -> list[tuple[str, MultiHeadAttention]]:
    """``(name, layer)`` of every headwise layer in ``module``, in model order.

    A bare :class:`MultiHeadAttention` is its own only layer (name ``""``); a model patched by
    :func:`headwise.interop.patch` lists what :func:`headwise.interop.layers` lists (named by the Hugging Face
    module); any other module lists its :class:`MultiHeadAttention` submodules by ``named_modules`` name.

    Shapes:
        each layer: MultiHeadAttention(d, h, h_kv, d_h)
    """
    if isinstance(module, MultiHeadAttention):
        return [("", module)]
    if not isinstance(module, nn.Module):
        raise TypeError(f"trace: module must be a MultiHeadAttention or a torch.nn.Module containing them, "
                        f"got {type(module).__name__}")
    try:
        from .interop import layers as patched_layers

        found = list(patched_layers(module))
    except ImportError:  # pragma: no cover - an interop without its optional peer
        found = []
    if not found:
        found = [(n, m) for n, m in module.named_modules() if isinstance(m, MultiHeadAttention)]
    if not found:
        raise TypeError(f"trace: {type(module).__name__} contains no MultiHeadAttention (patch a Hugging Face "
                        "model first with headwise.interop.patch)")
    return found


def head_results(z: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """Each head's write into the residual stream, ``z_h @ W_O^h``, as h GEMMs (one ``bmm``).

    Shapes:
        z: (b, h, s, d_h); w_o: (d, h * d_h) (``out_proj.weight``) -> (b, s, h, d)

    Example:
        >>> z, w = torch.randn(2, 3, 4, 5), torch.randn(6, 15)
        >>> torch.testing.assert_close(head_results(z, w).sum(2), z.transpose(1, 2).reshape(2, 4, 15) @ w.T)
    """
    b, h, s, d_h = z.shape
    d = w_o.shape[0]
    per_head = w_o.reshape(d, h, d_h).permute(1, 2, 0).to(z.dtype)  # (h, d_h, d): W_O^h
    rows = z.transpose(0, 1).reshape(h, b * s, d_h)  # (h, b * s, d_h)
    out = torch.bmm(rows, per_head)  # (h, b * s, d)
    return out.view(h, b, s, d).permute(1, 2, 0, 3)  # (b, s, h, d)


class LayerRecord:
    """What one layer reported during a trace: ``.q``, ``.k``, ``.v``, ``.pattern``, ``.z``, ``.result``.

    Each property is the tensor of the layer's one call; after several calls (decoding) ``q``, ``z`` and
    ``result`` are concatenated along the query positions, and ``calls`` holds every call's dict.

    Shapes:
        q (b, h, s_q, d_h); k, v (b, h_kv, s, d_h); pattern (b, h, s_q, s_kv); z (b, s_q, h, d_h);
        result (b, s_q, h, d)
    """

    def __init__(self, index: int, name: str, layer: MultiHeadAttention, capture: frozenset[str]) -> None:
        self.index, self.name, self.layer, self.capture = index, name, layer, capture
        self.calls: list[dict[str, torch.Tensor]] = []

    def get(self, what: str) -> torch.Tensor:
        """The captured ``what`` (one of :data:`CAPTURABLE`)."""
        if what not in CAPTURABLE:
            raise KeyError(f"{what!r} is not capturable; choose from {CAPTURABLE}")
        if what not in self.capture:
            raise KeyError(f"layer {self.index} ({self.name!r}) did not capture {what!r}: it captured "
                           f"{sorted(self.capture) or 'nothing'}; pass capture=(..., {what!r})")
        if not self.calls:
            raise ValueError(f"layer {self.index} ({self.name!r}) was not called inside the trace")
        if len(self.calls) == 1:
            return self.calls[0][what]
        if what not in _BY_POSITION:
            raise ValueError(f"layer {self.index} ran {len(self.calls)} times (e.g. decoding) and {what!r} of "
                             "different calls differ in length: use .calls[i][{what!r}]")
        return torch.cat([c[what] for c in self.calls], dim=_BY_POSITION[what])

    q = property(lambda self: self.get("q"), doc="Queries after rotary (b, h, s_q, d_h).")
    k = property(lambda self: self.get("k"), doc="Keys (b, h_kv, s, d_h).")
    v = property(lambda self: self.get("v"), doc="Values (b, h_kv, s, d_h).")
    pattern = property(lambda self: self.get("pattern"), doc="Probabilities (b, h, s_q, s_kv).")
    z = property(lambda self: self.get("z"), doc="Per-head context after edits (b, s_q, h, d_h).")
    result = property(lambda self: self.get("result"), doc="Per-head residual writes (b, s_q, h, d).")

    def __repr__(self) -> str:
        return (f"LayerRecord({self.index}, {self.name!r}, capture={sorted(self.capture)}, "
                f"calls={len(self.calls)})")


class _LayerTracer:
    """The object a traced layer calls (``MultiHeadAttention.tracer``): captures, then edits heads."""

    def __init__(self, record: LayerRecord, scale: list[float] | None,
                 others: list[tuple[int, Callable[[torch.Tensor], torch.Tensor]]]) -> None:
        self.record, self.scale, self.others = record, scale, others
        self.capture = record.capture
        self.pending: dict[str, torch.Tensor] = {}
        self.last_results: torch.Tensor | None = None

    def wants_weights(self, layer: MultiHeadAttention) -> bool:
        return "pattern" in self.capture

    def qkv(self, layer: MultiHeadAttention, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.pending = {n: t for n, t in (("q", q), ("k", k), ("v", v)) if n in self.capture}
        return q, k, v

    def context(self, layer: MultiHeadAttention, z: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        if self.scale is not None:  # "zero" and scales: one multiply by a per-head factor
            z = z * torch.tensor(self.scale, dtype=z.dtype, device=z.device).view(1, -1, 1, 1)
        if self.others:
            heads = list(z.unbind(1))  # h x (b, s_q, d_h)
            for i, fn in self.others:
                heads[i] = fn(heads[i])
            z = torch.stack(heads, dim=1)  # (b, h, s_q, d_h)
        if self.capture:
            call, self.pending = self.pending, {}
            if "pattern" in self.capture:
                call["pattern"] = weights
            if "z" in self.capture:
                call["z"] = z.transpose(1, 2)  # (b, s_q, h, d_h)
            if "result" in self.capture:
                call["result"] = self.last_results = head_results(z, layer.out_proj.weight)  # (b, s_q, h, d)
            self.record.calls.append(call)
        return z

    def results(self, layer: MultiHeadAttention) -> torch.Tensor | None:
        """The head writes the context step just captured, handed over once (the layer may sum them instead
        of a second W_O product), or None. Patched modules call ``project_out`` themselves and never ask."""
        results, self.last_results = self.last_results, None
        return results


class Trace:
    """A running (or finished) trace: ``t[i]`` / ``t["transformer.h.0.attn"]`` is a :class:`LayerRecord`.

    Use it as a context manager (see :func:`trace`); it is indexed like :func:`find_layers` (position,
    negative positions, or the layer's module name).
    """

    def __init__(self, module: nn.Module, capture: Any = (), edit: Mapping | None = None) -> None:
        self.layers = find_layers(module)
        self._names = {name: i for i, (name, _) in enumerate(self.layers)}
        per_layer = self._parse_capture(capture)
        self.records = [LayerRecord(i, n, m, per_layer.get(i, frozenset())) for i, (n, m) in enumerate(self.layers)]
        self._plans = self._parse_edits(edit)
        self._active = False

    # -- indexing ----------------------------------------------------------------------------------------
    def index(self, ref: Any) -> int:
        """The position of a layer given by position, module name or the layer object itself."""
        n = len(self.layers)
        if isinstance(ref, MultiHeadAttention):
            for i, (_, m) in enumerate(self.layers):
                if m is ref:
                    return i
            raise KeyError("that MultiHeadAttention is not one of the traced layers")
        if isinstance(ref, str):
            if ref not in self._names:
                raise KeyError(f"no traced layer is named {ref!r}; the layers are {list(self._names)}")
            return self._names[ref]
        if isinstance(ref, bool) or not isinstance(ref, int):
            raise TypeError(f"a layer is given by position (int), module name (str) or the layer itself, "
                            f"got {type(ref).__name__}")
        if not -n <= ref < n:
            raise IndexError(f"layer position must be in [-{n}, {n}) for these {n} layers, got {ref}")
        return ref % n

    def __getitem__(self, ref: Any) -> LayerRecord:
        return self.records[self.index(ref)]

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[LayerRecord]:
        return iter(self.records)

    @property
    def materializes_probabilities(self) -> list[str]:
        """Names of the layers whose probabilities this trace materialises (those capturing ``"pattern"``)."""
        return [r.name for r in self.records if "pattern" in r.capture]

    def __repr__(self) -> str:
        eager = self.materializes_probabilities
        return (f"Trace({len(self.records)} layers, edits on {sum(1 for p in self._plans if p)} layers, "
                + (f"materialises probabilities (eager path) in {eager})" if eager else "fused path kept)"))

    # -- the context manager -----------------------------------------------------------------------------
    def __enter__(self) -> "Trace":
        if self._active:
            raise RuntimeError("this trace is already active")
        busy = [n for n, m in self.layers if m.tracer is not None]
        if busy:
            raise RuntimeError(f"layers {busy} are already traced: traces do not nest")
        for record, (scale, others) in zip(self.records, self._plans):
            record.calls.clear()
            record.layer.tracer = _LayerTracer(record, scale, others)
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        for _, layer in self.layers:
            layer.__dict__.pop("tracer", None)  # back to the class default (None)
        self._active = False

    # -- arguments ---------------------------------------------------------------------------------------
    def _parse_capture(self, capture: Any) -> dict[int, frozenset[str]]:
        def names(value: Any) -> frozenset[str]:
            value = (value,) if isinstance(value, str) else value
            if not isinstance(value, (tuple, list, set, frozenset)):
                raise TypeError(f"capture takes names from {CAPTURABLE} (a tuple), got {type(value).__name__}")
            bad = [v for v in value if v not in CAPTURABLE]
            if bad:
                raise ValueError(f"capture: {bad} not capturable; choose from {CAPTURABLE}")
            return frozenset(value)

        if isinstance(capture, Mapping):
            return {self.index(ref): names(v) for ref, v in capture.items()}
        every = names(capture)
        return {i: every for i in range(len(self.layers))}

    def _parse_edits(self, edit: Mapping | None) -> list[tuple[list[float] | None, list]]:
        if edit is None:
            edit = {}
        if not isinstance(edit, Mapping):
            raise TypeError(f"edit must be a dict {{(layer, head): edit}}, got {type(edit).__name__}")
        chosen: dict[tuple[int, int], Any] = {}
        for key, value in edit.items():
            ref, heads = (key if isinstance(key, tuple) and len(key) == 2 else (key, None))
            li = self.index(ref)
            h = self.layers[li][1].n_heads
            for head in self._heads(heads, h, key):
                if (li, head) in chosen:
                    raise ValueError(f"edit: head {head} of layer {li} is edited twice (key {key!r})")
                chosen[(li, head)] = value
        plans: list[tuple[list[float] | None, list]] = [(None, []) for _ in self.layers]
        for (li, head), value in sorted(chosen.items()):
            layer = self.layers[li][1]
            scale, others = plans[li]
            factor, fn = _edit_of(value, self, li, head, layer)
            if factor is not None:
                scale = scale or [1.0] * layer.n_heads
                scale[head] = factor
            else:
                others.append((head, fn))
            plans[li] = (scale, others)
        return plans

    @staticmethod
    def _heads(heads: Any, h: int, key: Any) -> list[int]:
        if heads is None:
            return list(range(h))
        items = list(heads) if isinstance(heads, (list, tuple, range)) else [heads]
        for i in items:
            if isinstance(i, bool) or not isinstance(i, int):
                raise TypeError(f"edit key {key!r}: heads are ints, got {type(i).__name__}")
            if not -h <= i < h:
                raise IndexError(f"edit key {key!r}: head must be in [0, {h}), got {i}")
        return [i % h for i in items]


def _edit_of(value: Any, tr: Trace, li: int, head: int, layer: MultiHeadAttention):  # type: ignore[no-untyped-def]
    """(scale factor, None) for "zero" and numbers, else (None, fn(z_h) -> z_h). Shapes: z_h (b, s_q, d_h)."""
    d_h = layer.d_head
    if isinstance(value, str):
        if value == "zero":
            return 0.0, None
        if value == "mean":
            return None, lambda z_h: z_h.mean(dim=1, keepdim=True).expand_as(z_h)  # over this call's positions
        raise ValueError(f"edit: unknown edit {value!r}; use 'zero', 'mean', ('mean', reference_trace), a number, "
                         "a tensor or a callable (z_h, layer, head) -> z_h")
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and value[0] == "mean":
        ref = value[1]
        if not isinstance(ref, Trace) or len(ref) != len(tr):
            raise TypeError(f"edit ('mean', reference): reference must be a finished headwise.trace of the same "
                            f"{len(tr)} layers that captured 'z', got {type(ref).__name__}")
        zr = ref[li].z  # (b_ref, s_ref, h, d_h): mean over the reference batch and its positions
        return _replacement(zr[:, :, head].reshape(-1, d_h).mean(0).detach(), li, head, d_h)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"edit: a scale must be finite, got {value!r}")
        return float(value), None
    if isinstance(value, torch.Tensor):
        return _replacement(value, li, head, d_h)
    if callable(value):
        def call(z_h: torch.Tensor) -> torch.Tensor:
            out = value(z_h, li, head)
            if not isinstance(out, torch.Tensor) or out.shape != z_h.shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"edit of layer {li} head {head}: the callable must return a tensor of the "
                                 f"context's shape {tuple(z_h.shape)}, got {got}")
            return out
        return None, call
    raise TypeError(f"edit of layer {li} head {head}: expected 'zero', 'mean', ('mean', trace), a number, a "
                    f"tensor or a callable, got {type(value).__name__}")


def _replacement(t: torch.Tensor, li: int, head: int, d_h: int):  # type: ignore[no-untyped-def]
    if not t.is_floating_point() or t.dim() > 3 or t.dim() == 0 or t.shape[-1] != d_h:
        raise ValueError(f"edit of layer {li} head {head}: a replacement context is a floating tensor "
                         f"(d_h={d_h},), (s, d_h) or (b, s, d_h), got {t.dtype} {tuple(t.shape)}")

    def replace(z_h: torch.Tensor) -> torch.Tensor:
        try:
            shape = torch.broadcast_shapes(t.shape, z_h.shape)
        except RuntimeError:
            shape = None
        if shape != z_h.shape:
            raise ValueError(f"edit of layer {li} head {head}: replacement {tuple(t.shape)} does not broadcast to "
                             f"the context (b, s_q, d_h) = {tuple(z_h.shape)}")
        return t.to(device=z_h.device, dtype=z_h.dtype).expand_as(z_h)
    return None, replace


def trace(module: nn.Module, capture: Any = (), edit: Mapping | None = None) -> Trace:
    """Capture and edit every head of ``module``'s layers while its own forward runs (see the module doc).

    Args:
        module: a :class:`MultiHeadAttention`, a module containing them, or a patched Hugging Face model.
        capture: names from :data:`CAPTURABLE` for every layer, or ``{layer: names}``.
        edit: ``{(layer, head): e}`` (or ``{layer: e}`` for every head, ``{(layer, [heads]): e}``), ``e`` one
            of ``"zero"``, ``"mean"`` (over the call's positions), ``("mean", reference_trace)`` (over a
            reference batch's positions, captured with ``"z"``), a number (scale), a replacement tensor
            ((d_h,), (s, d_h) or (b, s, d_h)) or a callable ``(z_h, layer, head) -> z_h``.

    Shapes:
        z_h: (b, s_q, d_h) one head's context; layers are given by position or module name
    """
    return Trace(module, capture, edit)


class _CallableModule(types.ModuleType):
    """``headwise.trace`` is this module; calling it calls :func:`trace`."""

    def __call__(self, module: nn.Module, capture: Any = (), edit: Mapping | None = None) -> Trace:
        return trace(module, capture, edit)


sys.modules[__name__].__class__ = _CallableModule
