"""What :class:`~headwise.KVCache` is built from, below it: its messages and argument checks, the custom op that
raises its overflow from compiled code, and :class:`KVCheckpoint`, what :meth:`~headwise.KVCache.checkpoint` saves.
A leaf: it imports nothing from headwise. Its device and autocast checks serve the layer too (through
:mod:`headwise.validation`), so a cache and a layer refuse the same devices with the same words.

Shapes:
    b: batch, h_kv: key/value heads, n: saved positions, d_h: head width.
    KVCheckpoint keys, values: (b, h_kv, n, d_h)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["KVCheckpoint", "autocast_dtype", "check_count", "check_device", "check_write", "overflow_message",
           "short_name"]


def overflow_message(cached: int, new: int, max_len: int) -> str:
    """The overflow ``ValueError``'s message, the same from eager and compiled code."""
    return (f"cache overflow: {cached} cached + {new} new > max_len={max_len}; "
            f"allocate a larger cache or reset() it")


def check_device(name: str, device: object) -> None:
    """``device`` is None or names a device this machine has (checked before anything is allocated there, so
    a bad one is a ValueError naming it, not an error from inside the backend or an allocation)."""
    if device is None:
        return
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"{name} must be a torch.device, a str such as 'cpu' or 'cuda:0', or None, "
                        f"got {type(device).__name__}")
    try:
        dev = torch.device(device)
        if dev.type != "meta":
            torch.empty(0, device=dev)  # zero bytes: asks the backend whether the device exists
    except (RuntimeError, AssertionError, ValueError) as exc:
        # The backend's first sentence: a missing backend's message goes on to list every dispatch key.
        reason = str(exc).splitlines()[0].split(". ")[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{name} must name an available device (e.g. 'cpu'), got {device!r}: {reason}") from None


def autocast_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """The dtype the projections of a layer with parameters of ``dtype`` write on ``device`` under the
    ``torch.autocast`` now active there (it casts every floating dtype but float64), or None outside one.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     autocast_dtype(torch.float32, torch.device("cpu")), autocast_dtype(torch.float64, torch.device("cpu"))
        (torch.bfloat16, None)
        >>> autocast_dtype(torch.float32, torch.device("meta")) is None  # no autocast there: asking would raise
        True
    """
    kind = device.type
    if dtype == torch.float64 or not torch.amp.is_autocast_available(kind) or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def check_count(method: str, name: str, n: object, most: int | None) -> None:
    """``n`` is an int from 0 to ``most`` (no bound if None): else a TypeError or ValueError naming both."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{method}: {name} must be an int, got {type(n).__name__} {n!r}")
    if n < 0 or (most is not None and n > most):
        bound = "a non-negative int" if most is None else f"an int from 0 to {most} (the written positions)"
        raise ValueError(f"{method}: {name} must be {bound}, got {n}")


def check_write(held: torch.Tensor, k: Any, v: Any) -> None:
    """Every check of :meth:`~headwise.KVCache.check_update` but the overflow: ``k`` and ``v`` fit the cache
    whose key buffer is ``held``, (b, h_kv, max_len, d_h)."""
    b, h_kv, _, d_h = held.shape
    for name, t in (("keys", k), ("values", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"cache {name} must be a torch.Tensor, got {type(t).__name__}")
    expected = (b, h_kv, d_h)
    for name, t in (("keys", k), ("values", v)):
        if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != expected:
            raise ValueError(f"cache {name} must have shape (b={b}, h_kv={h_kv}, s, d_h={d_h}), got {tuple(t.shape)}")
        if t.dtype != held.dtype:
            hint = ""
            if autocast_dtype(t.dtype, t.device) == t.dtype:
                # Keys of the autocast dtype: a layer's checks pass a cache of its parameters' dtype, and
                # autocast changes what it writes.
                hint = (f" (under torch.autocast the projections write {t.dtype}: make the cache with "
                        f"dtype={t.dtype})")
            raise TypeError(f"cache holds {held.dtype}, got {name} of dtype {t.dtype}{hint}")
        if t.device != held.device:
            raise ValueError(f"cache is on {held.device}, got {name} on {t.device}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"keys and values must have the same length, got {k.shape[-2]} and {v.shape[-2]}")


def short_name(obj: object) -> str:
    """``<Class at 0x...>``: an object named without its repr (a layer's repr is many lines)."""
    return f"<{type(obj).__qualname__} at {id(obj):#x}>"


# Under torch.compile(fullgraph=True) a Python ``raise`` cannot leave the graph (dynamo reports
# "Observed exception"), and an f-string of the symbolic cache length does not even trace ("BUILD_STRING").
# So the compiled overflow branch calls this op instead: its kernel runs when the graph runs, with the
# concrete lengths, and raises the same ValueError as eager code. The normal path never calls it (that
# branch is only traced after the length guard fails), so it costs nothing per decoding step.
if not hasattr(torch.ops.headwise, "kv_cache_overflow"):
    @torch.library.custom_op("headwise::kv_cache_overflow", mutates_args=())
    def _overflow_op(new: torch.Tensor, cached: torch.Tensor, max_len: int) -> torch.Tensor:
        # ``cached`` is the cache's position tensor, read when the graph runs: compiled steps advance it on the
        # device, not the host's length
        raise ValueError(overflow_message(int(cached), new.shape[-2], max_len))

    @_overflow_op.register_fake
    def _(new: torch.Tensor, cached: torch.Tensor, max_len: int) -> torch.Tensor:
        return torch.empty_like(new)

    # AOTAutograd (aot_eager, inductor) traces the backward of a step that autograd records while compiling it,
    # and refuses an op without a formula: the overflow would fail compilation instead of raising at run time.
    # The kernel never returns, so the formula never runs; the identity is the simplest traceable one.
    def _overflow_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None

    torch.library.register_autograd("headwise::kv_cache_overflow", _overflow_backward,
                                    setup_context=lambda ctx, inputs, output: None)


class KVCheckpoint:
    """What :meth:`KVCache.checkpoint` saved: the length and the slots the next write may overwrite
    (``cuts``: how many crops the cache had made when it was taken)."""

    __slots__ = ("cache", "length", "resets", "keys", "values", "cuts")

    def __init__(self, cache: Any, length: int, resets: int, keys: torch.Tensor, values: torch.Tensor,
                 cuts: int = 0) -> None:
        self.cache, self.length, self.resets, self.keys, self.values = cache, length, resets, keys, values
        self.cuts = cuts

    def __repr__(self) -> str:
        return f"KVCheckpoint(length={self.length}, saved={self.keys.shape[-2]})"
