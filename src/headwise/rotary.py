"""Rotary position embeddings (RoPE), Hugging Face's half-rotation convention.

The head width is split in two halves ``(x1, x2)``; feature pair ``(x1[i], x2[i])`` is rotated by angle
``position * inv_freq[i]`` with ``inv_freq[i] = base ** (-2i / rotary_dim)``. Applied to Q and K of every
head separately, after the head split, so it never mixes heads.

Shapes:
    b: batch, h: heads, s: sequence, d_h: head width.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "rotate_half", "apply_rotary"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the last axis.

    Shapes:
        x: (..., r) with r even -> (..., r)

    Example:
        >>> rotate_half(torch.tensor([1., 2., 3., 4.])).tolist()
        [-3.0, -4.0, 1.0, 2.0]
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` features of each head; the rest pass through.

    Shapes:
        x: (b, h, s, d_h); cos, sin: (b, 1, s, r) or (1, 1, s, r) with r <= d_h even -> (b, h, s, d_h)
    """
    r = cos.shape[-1]
    half = r // 2
    # x * cos + rotate_half(x) * sin, with the rotate_half term accumulated in place into one fresh output:
    # one allocation instead of five (neg, cat, two products, sum): the rotation is memory-bound.
    out = x * cos if r == x.shape[-1] else torch.cat((x[..., :r] * cos, x[..., r:]), dim=-1)
    out[..., :half].addcmul_(x[..., half:r], sin[..., :half], value=-1)  # first half: x1 cos - x2 sin
    out[..., half:r].addcmul_(x[..., :half], sin[..., half:])  # second half: x2 cos + x1 sin
    return out


class RotaryEmbedding(nn.Module):
    """Rotary embedding for one layer's heads; pass it as ``MultiHeadAttention(..., rotary=...)``.

    Args:
        d_head: head width the rotation applies to.
        base: the theta of the frequencies (10000 for Llama-2, 500000 for Llama-3).
        rotary_dim: rotate only the first ``rotary_dim`` features of each head (default: all).
        inv_freq: explicit inverse frequencies ``(rotary_dim // 2,)``, for scaled variants (e.g. Llama-3's
            rope scaling) computed elsewhere; overrides ``base``.
        attention_scaling: multiplies cos and sin (used by some scaled-RoPE variants; 1.0 otherwise).
        max_positions: the first position these frequencies do not hold for (a variant whose model switches them
            with the sequence length: dynamic NTK past ``max_position_embeddings``, longrope past
            ``original_max_position_embeddings``); positions reaching it raise ``ValueError`` outside
            ``torch.compile``. None (default): no limit.
        rope_type: the variant's name, for that message.

    ``inv_freq`` stays float32 through dtype casts (``.to(torch.bfloat16)``, ``.half()``): a position times a
    bfloat16 frequency is off by radians at a few thousand positions. (A transformers model loaded in bfloat16 keeps
    float32 frequencies too; one cast with ``model.to(torch.bfloat16)`` rounds its buffer, and so differs from this
    layer's exact ones at long positions.)

    Shapes:
        positions: (s,) or (b, s) int -> cos, sin: (b or 1, 1, s, rotary_dim), float32

    Example:
        >>> rope = RotaryEmbedding(8)
        >>> q = torch.randn(1, 2, 3, 8)
        >>> cos, sin = rope(torch.arange(3))
        >>> q_rot = apply_rotary(q, cos, sin)
        >>> torch.testing.assert_close(q_rot.norm(dim=-1), q.norm(dim=-1))   # a rotation keeps norms
    """

    inv_freq: torch.Tensor

    def __init__(self, d_head: int, *, base: float = 10000.0, rotary_dim: int | None = None,
                 inv_freq: torch.Tensor | None = None, attention_scaling: float = 1.0,
                 max_positions: int | None = None, rope_type: str = "default") -> None:
        super().__init__()
        for name, value in (("d_head", d_head), ("rotary_dim", rotary_dim)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        if d_head <= 0:
            raise ValueError(f"d_head must be a positive int, got {d_head}")
        rotary_dim = d_head if rotary_dim is None else rotary_dim
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > d_head:
            raise ValueError(f"rotary_dim must be even and in (0, d_head={d_head}], got {rotary_dim}")
        if inv_freq is None:
            if not 0 < base < math.inf:  # NaN fails too
                raise ValueError(f"base must be positive, got {base}" if not base > 0 else f"base must be finite, got {base}")
            inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        elif not isinstance(inv_freq, torch.Tensor) or not inv_freq.dtype.is_floating_point:
            got = inv_freq.dtype if isinstance(inv_freq, torch.Tensor) else type(inv_freq).__name__
            hint = "; convert it with torch.from_numpy(inv_freq)" if type(inv_freq).__module__ == "numpy" else ""
            raise TypeError(f"inv_freq must be a floating torch.Tensor of shape ({rotary_dim // 2},), got {got}{hint}")
        elif tuple(inv_freq.shape) != (rotary_dim // 2,):
            raise ValueError(f"inv_freq must have shape ({rotary_dim // 2},), got {tuple(inv_freq.shape)}")
        elif not bool(torch.isfinite(inv_freq).all()):
            raise ValueError("inv_freq must be finite, got NaN or infinite entries")
        self.d_head, self.rotary_dim, self.base = d_head, rotary_dim, base
        if isinstance(attention_scaling, bool) or not isinstance(attention_scaling, (int, float)) \
                or not (math.isfinite(attention_scaling) and attention_scaling > 0):
            raise ValueError(f"attention_scaling must be a positive finite float, got {attention_scaling!r}")
        self.attention_scaling = float(attention_scaling)
        if max_positions is not None and (isinstance(max_positions, bool) or not isinstance(max_positions, int)):
            raise TypeError(f"max_positions must be an int or None, got {type(max_positions).__name__}")
        if max_positions is not None and max_positions <= 0:
            raise ValueError(f"max_positions must be positive, got {max_positions}")
        if not isinstance(rope_type, str):
            raise TypeError(f"rope_type must be a str, got {type(rope_type).__name__}")
        self.max_positions, self.rope_type = max_positions, rope_type
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RotaryEmbedding:
        exact = self.inv_freq
        super()._apply(fn, recurse)
        moved = self.inv_freq
        # A dtype cast must not round the frequencies: keep the float32 values, on the tensor's new device.
        if exact.dtype == torch.float32 and moved.dtype != torch.float32:
            self.inv_freq = exact.to(moved.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions``, computed in float32 (Hugging Face's precision) or float64 when asked."""
        if (not isinstance(positions, torch.Tensor) or positions.dim() not in (1, 2)
                or positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool):
            got = (f"{tuple(positions.shape)} {positions.dtype}" if isinstance(positions, torch.Tensor)
                   else type(positions).__name__)
            raise TypeError(f"positions must be an integer tensor of shape (s,) or (b, s), got {got}")
        if self.max_positions is not None and positions.numel() and not torch.compiler.is_compiling():
            last = int(positions.max())  # a host sync, paid only by variants with a limit
            if last >= self.max_positions:
                raise ValueError(
                    f"positions reach {last}, but this {self.rope_type} rotary's frequencies hold only for positions "
                    f"< {self.max_positions} (max_positions): past it the model switches them with the sequence "
                    "length. For longer sequences run the model itself (a patched Hugging Face model takes "
                    "transformers' own rotary)")
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)  # (1, s)
        work = torch.float64 if dtype == torch.float64 else torch.float32
        freqs = positions[..., None].to(work) * self.inv_freq.to(positions.device, work)  # (b, s, r / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (b, s, r)
        cos = (emb.cos() * self.attention_scaling)[:, None]  # (b, 1, s, r)
        sin = (emb.sin() * self.attention_scaling)[:, None]  # (b, 1, s, r)
        return cos, sin

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate Q and K at their positions: angles in float32 as Hugging Face does (float64 for float64
        inputs), the rotation in the input dtype.

        Shapes:
            q: (b, h, s, d_h); k: (b, h_kv, s, d_h); positions: (s,) or (b, s)
        """
        for name, t in (("q", q), ("k", k)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[-1] != self.d_head:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must have shape (b, heads, s, d_h={self.d_head}), got {got}")
        cos, sin = self(positions, q.dtype)
        if cos.shape[-2] != q.shape[-2] or k.shape[-2] != q.shape[-2]:
            raise ValueError(f"positions give s={cos.shape[-2]} but q has s={q.shape[-2]} and k has s={k.shape[-2]}")
        return (apply_rotary(q, cos.to(q.dtype), sin.to(q.dtype)),
                apply_rotary(k, cos.to(k.dtype), sin.to(k.dtype)))

    def extra_repr(self) -> str:
        limit = ("" if self.max_positions is None
                 else f", rope_type={self.rope_type}, max_positions={self.max_positions}")
        return f"d_head={self.d_head}, rotary_dim={self.rotary_dim}, base={self.base}{limit}"
