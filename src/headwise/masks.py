"""Masks: which key positions each query (of each head) may read.

One convention everywhere in headwise: a **bool mask is True where attention is allowed**; a floating
mask is **added to the scores** (0 = allowed, ``-inf`` = blocked). Both broadcast to ``(b, h, s_q, s_kv)``.
This is SDPA's convention and the opposite of ``nn.MultiheadAttention``'s ``key_padding_mask``
(True = ignore); :func:`padding_mask` takes lengths or a keep-mask so the polarity is never guessed.

Causal masks come in two alignments, and they differ only when ``s_q != s_kv``:

* ``"bottom_right"`` (headwise's default, and what decoding needs): query ``i`` sits at absolute position
  ``s_kv - s_q + i`` and reads keys ``0 .. s_kv - s_q + i``. A single new token reads the whole cache.
* ``"top_left"``: query ``i`` reads keys ``0 .. i`` (what ``F.scaled_dot_product_attention(is_causal=True)``
  does when ``s_q != s_kv``).

A query row that may read no key at all yields a zero context and zero weights, never NaN.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads.
"""

from __future__ import annotations

import torch

__all__ = [
    "causal_mask",
    "padding_mask",
    "sliding_window_mask",
    "combine_masks",
    "validate_mask",
    "open_dead_rows",
    "ALIGNMENTS",
]

ALIGNMENTS = ("bottom_right", "top_left")


def _check_align(align: str) -> None:
    if align not in ALIGNMENTS:
        raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")


def _type_name(value: object) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _check_len(name: str, value: int, low: int = 0) -> None:
    kind = "non-negative" if low == 0 else "positive"
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):  # SymInt: a traced (exported) size
        raise TypeError(f"{name} must be a {kind} int, got {value!r} ({_type_name(value)})")
    if value < low:
        raise ValueError(f"{name} must be a {kind} int, got {value!r}")


def causal_mask(
    s_q: int, s_kv: int | None = None, *, align: str = "bottom_right", device: torch.device | str | None = None
) -> torch.Tensor:
    """Bool causal mask, True where query ``i`` may read key ``j``.

    Shapes:
        returns (s_q, s_kv), broadcastable to (b, h, s_q, s_kv).

    Example:
        >>> causal_mask(2, 3).int().tolist()          # bottom-right: the 2 queries are positions 1, 2
        [[1, 1, 0], [1, 1, 1]]
        >>> causal_mask(2, 3, align="top_left").int().tolist()
        [[1, 0, 0], [1, 1, 0]]
    """
    s_kv = s_q if s_kv is None else s_kv
    _check_len("s_q", s_q)
    _check_len("s_kv", s_kv)
    _check_align(align)
    offset = s_kv - s_q if align == "bottom_right" else 0
    i = torch.arange(s_q, device=device).unsqueeze(-1)
    j = torch.arange(s_kv, device=device)
    return j <= i + offset


def sliding_window_mask(
    s_q: int, s_kv: int | None = None, *, window: int, align: str = "bottom_right",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Causal mask that also forgets keys more than ``window - 1`` positions back (Mistral-style).

    Query at absolute position p reads keys ``p - window + 1 .. p``.

    Shapes:
        returns (s_q, s_kv) bool.

    Example:
        >>> sliding_window_mask(4, window=2).int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    """
    s_kv = s_q if s_kv is None else s_kv
    _check_len("window", window, low=1)
    allowed = causal_mask(s_q, s_kv, align=align, device=device)
    offset = s_kv - s_q if align == "bottom_right" else 0
    i = torch.arange(s_q, device=device).unsqueeze(-1) + offset
    j = torch.arange(s_kv, device=device)
    return allowed & (j > i - window)


def padding_mask(
    keep: torch.Tensor | None = None, *, lengths: torch.Tensor | list[int] | None = None,
    s_kv: int | None = None, left: bool = False,
) -> torch.Tensor:
    """Key padding mask shaped to broadcast over heads and queries, True = real token.

    Pass either ``keep`` (bool ``(b, s_kv)``, True = real token; Hugging Face's ``attention_mask``
    as bool) or ``lengths`` (a tensor, list or numpy array of ints) with ``s_kv`` (padding on the right,
    or on the left with ``left=True``).
    To convert ``nn.MultiheadAttention``'s ``key_padding_mask`` (True = ignore), pass ``keep=~kpm``.

    Shapes:
        keep: (b, s_kv) -> returns (b, 1, 1, s_kv).

    Example:
        >>> padding_mask(lengths=[2, 3], s_kv=3)[:, 0, 0].int().tolist()
        [[1, 1, 0], [1, 1, 1]]
        >>> padding_mask(lengths=[2], s_kv=3, left=True)[:, 0, 0].int().tolist()
        [[0, 1, 1]]
    """
    if (keep is None) == (lengths is None):
        raise ValueError("pass exactly one of keep= (bool (b, s_kv)) or lengths= (with s_kv=)")
    if keep is not None:
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.dim() != 2:
            got = f"{tuple(keep.shape)} {keep.dtype}" if isinstance(keep, torch.Tensor) else _type_name(keep)
            raise TypeError(f"keep must be a bool tensor of shape (b, s_kv), got {got}")
        return keep[:, None, None, :]  # (b, 1, 1, s_kv)
    if s_kv is not None:
        _check_len("s_kv", s_kv)
    try:
        lengths_t = torch.as_tensor(lengths)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"lengths must be a 1-D integer sequence (b,), got {lengths!r} ({_type_name(lengths)})") from None
    if lengths_t.numel() == 0 and not isinstance(lengths, torch.Tensor):
        lengths_t = lengths_t.long()  # [] parses as float32, but an empty batch is still a valid batch
    if lengths_t.dim() != 1 or lengths_t.dtype.is_floating_point or lengths_t.dtype == torch.bool:
        raise TypeError(f"lengths must be a 1-D integer sequence (b,), got {tuple(lengths_t.shape)} {lengths_t.dtype}")
    lengths_t = lengths_t.long()  # s_kv - lengths in a small integer dtype (uint8, int8) wraps around
    if s_kv is None:
        s_kv = int(lengths_t.max()) if lengths_t.numel() else 0
    if lengths_t.numel() and (int(lengths_t.min()) < 0 or int(lengths_t.max()) > s_kv):
        raise ValueError(f"lengths must lie in [0, s_kv={s_kv}], got {lengths_t.tolist()}")
    j = torch.arange(s_kv, device=lengths_t.device)
    keep_t = j >= (s_kv - lengths_t[:, None]) if left else j < lengths_t[:, None]
    return keep_t[:, None, None, :]  # (b, 1, 1, s_kv)


def combine_masks(*masks: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Intersect masks: a position is allowed only if every mask allows it.

    Bool masks are and-ed; if any mask is floating, the result is an additive mask (bool masks become
    ``0 / -inf``) of ``dtype`` (default: the first floating mask's dtype). ``None`` entries are skipped.

    Shapes:
        each mask broadcastable to (b, h, s_q, s_kv); returns their broadcast shape.

    Example:
        >>> a = causal_mask(3)
        >>> b = padding_mask(lengths=[2], s_kv=3)
        >>> combine_masks(a, b)[0, 0].int().tolist()
        [[1, 0, 0], [1, 1, 0], [1, 1, 0]]
    """
    present = [m for m in masks if m is not None]
    if not present:
        return None
    for m in present:
        _check_dtype(m)
    shapes = [tuple(m.shape) for m in present]
    try:
        torch.broadcast_shapes(*shapes)
    except RuntimeError:
        raise ValueError(f"masks of shapes {shapes} do not broadcast together; each must broadcast to "
                         f"(b, h, s_q, s_kv)") from None
    devices = {m.device for m in present}
    if len(devices) > 1:
        raise ValueError(f"masks must be on one device, got {sorted(str(d) for d in devices)}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype (the additive mask's), got {dtype!r}")
    floats = [m for m in present if m.dtype.is_floating_point]
    if not floats:
        out = present[0]
        for m in present[1:]:
            out = out & m
        return out
    dtype = dtype or floats[0].dtype
    out = None
    for m in present:
        add = _to_additive(m, dtype)
        out = add if out is None else out + add
    return out


def _to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def _check_dtype(mask: torch.Tensor) -> None:
    if not isinstance(mask, torch.Tensor):
        hint = "; convert it with torch.from_numpy(mask)" if type(mask).__module__ == "numpy" else ""
        raise TypeError(f"mask must be a torch.Tensor (bool: True = may attend; or floating: added to scores), "
                        f"got {_type_name(mask)}{hint}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        hint = "; a 0/1 integer mask is not added to the scores: pass mask.bool()" if not mask.dtype.is_complex else ""
        raise TypeError(f"mask must be bool (True = may attend) or floating (added to the scores), "
                        f"got {mask.dtype}{hint}")


def validate_mask(mask: torch.Tensor, target: tuple[int, int, int, int], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """Check that ``mask`` broadcasts to ``target = (b, h, s_q, s_kv)``; return it 4-D, ready for a kernel.

    A mask of fewer than 4 dims comes back as a 4-D view (leading size-1 axes, no copy), so every backend
    sees the same rank: ``(s_kv,)`` means one key mask for every query, ``()`` one value for everything.
    Floating masks are cast to the query dtype (SDPA requires it); bool masks keep their values.
    Only metadata (type, dtype, shape, device) is checked: no tensor data is read.

    Shapes:
        mask: any shape broadcastable to (b, h, s_q, s_kv) -> returns a 4-D view of it.

    Example:
        >>> m = validate_mask(torch.tensor([True, False]), (2, 4, 3, 2), torch.float32, torch.device("cpu"))
        >>> m.shape
        torch.Size([1, 1, 1, 2])
    """
    _check_dtype(mask)
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device}, but the inputs are on {device}")
    shape = tuple(mask.shape)
    ok = len(shape) <= 4
    for m, t in zip(reversed(shape), reversed(target)):  # a loop, not all(...): no generator frame per call
        ok = ok and (m == 1 or m == t)  # not `m in (1, t)`: dynamo folds that to False for a symbolic t
    if not ok:
        raise ValueError(
            f"mask of shape {shape} does not broadcast to (b, h, s_q, s_kv) = {tuple(target)}; "
            f"use (s_q, s_kv), (b, 1, s_q, s_kv), (b, 1, 1, s_kv) or (b, h, s_q, s_kv)"
        )
    if mask.dtype.is_floating_point and mask.dtype != dtype:
        mask = mask.to(dtype)
    if mask.dim() < 4:
        mask = mask.view((1,) * (4 - mask.dim()) + shape)  # (1.., *shape): leading unit axes are always a view
    return mask


def open_dead_rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Find the query rows that may read no key at all (every entry False, or ``-inf``), and open them to every
    key, so that no kernel divides 0 by 0 on them (forward or backward); the caller zeros those rows' outputs.

    Tensor operations on the mask's own broadcast shape (usually without a head axis): no host synchronisation,
    so it traces under ``torch.compile`` and CUDA graphs. One exception, where reading the mask is free: an
    eager CPU call (not compiled, not inside a ``torch.func`` transform) whose mask has no such row gets the mask
    back unchanged and ``None``, so the caller skips a pass over the scores or the context that would multiply
    by one.

    Shapes:
        mask: (b or 1, h or 1, s_q or 1, s_kv or 1) -> the opened mask (same shape), dead rows
        (b or 1, h or 1, s_q or 1, 1) bool, or None

    Example:
        >>> opened, dead = open_dead_rows(torch.tensor([[True, False], [False, False]]))
        >>> opened.tolist(), dead.flatten().tolist()
        ([[True, False], [True, True]], [False, True])
        >>> open_dead_rows(torch.tensor([[True, False], [False, True]]))[1] is None
        True
    """
    if mask.shape[-1] == 0:  # no key at all: every row is dead
        dead = torch.ones(mask.shape[:-1] + (1,), dtype=torch.bool, device=mask.device)
    elif mask.dtype == torch.bool:
        dead = ~mask.amax(-1, keepdim=True)  # amax, not any: several times faster on CPU, the same answer
    else:
        dead = mask.amax(-1, keepdim=True) == float("-inf")  # one reduction, then a compare on (.., s_q, 1)
    # Read without a synchronisation or a graph break: a plain CPU tensor, outside compiled code and torch.func
    if (not torch.compiler.is_compiling() and type(dead) is torch.Tensor and dead.device.type == "cpu"
            and not torch._C._functorch.is_functorch_wrapped_tensor(dead) and not dead.any()):
        return mask, None
    return (mask | dead, dead) if mask.dtype == torch.bool else (mask.masked_fill(dead, 0.0), dead)
