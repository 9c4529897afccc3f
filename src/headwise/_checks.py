"""Input validation shared by the public entry points: every message names expected and received."""

from __future__ import annotations

import torch

_SHAPES = "b: batch, s: sequence"


def check_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_input(name: str, x: object, width: int, width_name: str, dtype: torch.dtype,
                device: torch.device, *, batched: bool | None = None) -> torch.Tensor:
    """``x`` must be ``(b, s, width)`` (or ``(s, width)``) of the weights' dtype and device."""
    x = check_tensor(name, x)
    if x.dim() not in (2, 3) or x.shape[-1] != width:
        raise ValueError(
            f"{name} must have shape (b, s, {width_name}={width}) or (s, {width_name}={width}), "
            f"got {tuple(x.shape)}"
        )
    if batched is not None and (x.dim() == 3) != batched:
        want = "batched (b, s, width)" if batched else "unbatched (s, width)"
        raise ValueError(f"{name} must be {want} like the query input, got {tuple(x.shape)}")
    if x.dtype != dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but the weights are {dtype}; convert one of them "
                        f"(e.g. x.to({dtype}) or module.to({x.dtype}))")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the weights are on {device}")
    return x


def check_causal(causal: object) -> None:
    # A string such as "top_left" is truthy and would silently mean bottom-right.
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool (True = bottom-right aligned), got {causal!r}; for top-left "
                        f"alignment pass mask=headwise.masks.causal_mask(s_q, s_kv, align='top_left')")


def check_positions(positions: object, b: int, s: int) -> torch.Tensor:
    """Rotary positions: an integer tensor ``(s,)``, ``(1, s)`` or ``(b, s)``."""
    positions = check_tensor("positions", positions)
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
    if tuple(positions.shape) not in ((s,), (1, s), (b, s)):
        raise ValueError(f"positions must have shape (s_q={s},) or (b={b}, s_q={s}), got {tuple(positions.shape)}")
    return positions
