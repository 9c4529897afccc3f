"""The frozen description of one attention layer: widths, head counts, biases.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads (``n_heads``),
    h_kv: key/value heads (``n_kv_heads``), d: model width (``d_model``), d_h: head width (``d_head``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


__all__ = ["AttentionConfig", "valid_head_counts"]


#: The largest size torch can hold (sizes are int64); bigger widths or head counts describe no tensor.
MAX_SIZE = 2**63 - 1

def type_name(value: object) -> str:
    """``float`` for builtins, ``numpy.float32`` for everything else: what a message says was received."""
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def check_scale(scale: object, name: str = "scale") -> None:
    """A score scale (or a softcap): None or a positive finite number."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a float or None, got {scale!r} ({type_name(scale)})")
    if not 0 < scale <= _FLOAT_MAX:  # NaN fails; an int beyond any float (10**400) too
        raise ValueError(f"{name} must be a positive finite float or None, got {scale!r}")


def check_dropout(p: object) -> None:
    """A dropout probability in [0, 1)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"dropout must be a float in [0, 1), got {p!r} ({type_name(p)})")
    if not 0 <= p < 1:  # NaN fails both; no float(): an int beyond any float (10**400) would overflow
        raise ValueError(f"dropout must be in [0, 1), got {p}")


_FLOAT_MAX = 1.7976931348623157e308  # the largest finite float64

#: Head counts above this are not searched when an error suggests valid ones (no real layer has more).
MAX_SUGGESTED_HEADS = 4096


def valid_head_counts(d_model: int, limit: int = MAX_SUGGESTED_HEADS) -> list[int]:
    """The head counts up to ``limit`` that divide ``d_model`` (the only ones without an explicit ``d_head``):
    a plain loop over small divisors.

    Example:
        >>> valid_head_counts(12)
        [1, 2, 3, 4, 6, 12]
        >>> valid_head_counts(10**12 + 1)   # 73 * 137 * 99990001: only the small divisors are listed
        [1, 73, 137]
    """
    if isinstance(d_model, bool) or not isinstance(d_model, int) or not 1 <= d_model <= MAX_SIZE:
        exc = ValueError if isinstance(d_model, int) and not isinstance(d_model, bool) else TypeError
        raise exc(f"valid_head_counts needs a positive int at most 2**63 - 1, got {d_model!r} "
                  f"({type_name(d_model)})")
    return [n for n in range(1, min(d_model, limit) + 1) if d_model % n == 0]


def _nearest(values: list[int], target: int, k: int = 4) -> list[int]:
    # Head counts scale geometrically (8, 16, 32...), so "near" is measured as a ratio.
    return sorted(sorted(values, key=lambda v: (abs(math.log(v / target)), v))[:k])


def _check_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type_name(value)})")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    if value > MAX_SIZE:
        raise ValueError(f"{name} must be at most 2**63 - 1 (the largest torch size), got {value}")


@dataclass(frozen=True)
class AttentionConfig:
    """Configuration of a multi-head attention layer; validated once, at construction.

    ``n_kv_heads=None`` means one K/V head per query head (MHA); ``1`` is MQA; anything between is GQA,
    where query head ``i`` reads K/V head ``i // (n_heads // n_kv_heads)``. ``d_head=None`` means
    ``d_model // n_heads`` and then ``n_heads`` must divide ``d_model``; an explicit ``d_head`` may give
    ``n_heads * d_head != d_model`` (W_O is then ``(n_heads * d_head, d_model)``).

    Fields left as ``None`` are resolved to their defaults; a value you pass is never changed.
    Use :meth:`replace` (not ``dataclasses.replace``) to derive a config: it re-resolves the
    defaults instead of carrying over values resolved for the old one.

    Shapes:
        d = d_model, h = n_heads, h_kv = n_kv_heads, d_h = d_head.
        W_Q: (d, h * d_h); W_K: (kdim, h_kv * d_h); W_V: (vdim, h_kv * d_h); W_O: (h * d_h, d).

    Example:
        >>> cfg = AttentionConfig(d_model=4096, n_heads=32)
        >>> cfg.d_head, cfg.n_kv_heads, cfg.group_size
        (128, 32, 1)
        >>> AttentionConfig(d_model=4096, n_heads=32, n_kv_heads=8).group_size
        4
        >>> cfg.replace(n_heads=64).d_head
        64
    """

    d_model: int
    n_heads: int
    n_kv_heads: int | None = None
    d_head: int | None = None
    bias: bool = True
    out_bias: bool | None = None
    dropout: float = 0.0
    kdim: int | None = None
    vdim: int | None = None
    scale: float | None = None
    _given: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = frozenset(f.name for f in dataclasses.fields(self) if f.init and getattr(self, f.name) is not None)
        object.__setattr__(self, "_given", given)
        _check_int("d_model", self.d_model)
        _check_int("n_heads", self.n_heads)
        _check_int("n_kv_heads", self.n_kv_heads, allow_none=True)
        _check_int("d_head", self.d_head, allow_none=True)
        _check_int("kdim", self.kdim, allow_none=True)
        _check_int("vdim", self.vdim, allow_none=True)
        if self.d_head is None and self.d_model % self.n_heads:
            ok = _nearest(valid_head_counts(self.d_model), self.n_heads)
            raise ValueError(
                f"n_heads={self.n_heads} does not divide d_model={self.d_model}; head counts that do "
                f"near {self.n_heads}: {ok} (or pass d_head explicitly)"
            )
        n_kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        if self.n_heads % n_kv:
            ok = valid_head_counts(self.n_heads)
            raise ValueError(
                f"n_kv_heads={n_kv} does not divide n_heads={self.n_heads}; valid n_kv_heads: {ok}"
            )
        check_dropout(self.dropout)
        check_scale(self.scale)
        if not isinstance(self.bias, bool):  # None is no default here: only out_bias=None means "as bias"
            raise TypeError(f"bias must be a bool, got {self.bias!r} ({type_name(self.bias)})")
        if self.out_bias is not None and not isinstance(self.out_bias, bool):
            raise TypeError(f"out_bias must be a bool or None, got {self.out_bias!r} ({type_name(self.out_bias)}); "
                            "None means the same as bias")
        object.__setattr__(self, "n_kv_heads", n_kv)
        if self.d_head is None:
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        for name in ("kdim", "vdim"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.d_model)
        if self.out_bias is None:
            object.__setattr__(self, "out_bias", self.bias)
        if self.scale is None:
            object.__setattr__(self, "scale", 1.0 / math.sqrt(self.d_head))

    @property
    def group_size(self) -> int:
        """Query heads per K/V head (1 for MHA, ``n_heads`` for MQA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def kind(self) -> str:
        """``"MHA"``, ``"GQA"`` or ``"MQA"``."""
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"

    @property
    def inner_dim(self) -> int:
        """Width of the concatenated heads, ``n_heads * d_head`` (the input width of W_O)."""
        return self.n_heads * self.d_head

    @property
    def kv_dim(self) -> int:
        """Width of the packed K (or V) projection, ``n_kv_heads * d_head``."""
        return self.n_kv_heads * self.d_head

    def kv_head_of(self, head: int) -> int:
        """The K/V head that query head ``head`` reads (the SDPA ``enable_gqa`` / Hugging Face rule)."""
        if isinstance(head, bool) or not isinstance(head, int):
            raise TypeError(f"head index must be an int, got {head!r} ({type_name(head)})")
        if not 0 <= head < self.n_heads:
            raise IndexError(f"head index must be in [0, {self.n_heads}), got {head}")
        return head // self.group_size

    def replace(self, **changes: Any) -> "AttentionConfig":
        """A new config with ``changes``; fields you never set are resolved afresh."""
        kept = {name: getattr(self, name) for name in self._given}
        kept.update(changes)
        return AttentionConfig(**kept)

    def to_dict(self) -> dict[str, Any]:
        """All resolved fields, for JSON output."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
