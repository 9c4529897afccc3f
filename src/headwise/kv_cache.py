"""A preallocated key/value cache for autoregressive decoding.

It stores only the ``n_kv_heads`` K/V heads (GQA and MQA shrink it by ``n_heads / n_kv_heads``), in
buffers allocated once, so decoding never reallocates or copies what is already cached. Every write is
validated before anything is touched: a write that fails leaves the cache exactly as it was.

Shapes:
    b: batch, h_kv: key/value heads, s: new tokens, d_h: head width.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache"]


class KVCache:
    """Key/value buffers of one attention layer.

    Memory: ``2 * b * max_len * n_kv_heads * d_head * itemsize`` bytes (:attr:`nbytes`).

    A plain object rather than an ``nn.Module`` on purpose: ``torch.compile`` treats integer attributes of
    modules as constants, so a module's ``length`` would recompile the decode step at every position;
    a plain attribute becomes a dynamic size after the first recompile, and one graph serves all positions.

    Shapes:
        keys, values: (b, h_kv, max_len, d_h); the filled prefix is ``[:, :, :length]``.

    Example:
        >>> cache = KVCache(batch_size=2, max_len=16, n_kv_heads=4, d_head=8)
        >>> cache.nbytes == 2 * 2 * 16 * 4 * 8 * 4
        True
        >>> k, v = cache.update(torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8))
        >>> k.shape, cache.length
        (torch.Size([2, 4, 3, 8]), 3)
    """

    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, batch_size: int, max_len: int, n_kv_heads: int, d_head: int, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        # batch_size may be 0 (an empty batch decodes to empty outputs, like every other path).
        for name, value, low in (("batch_size", batch_size, 0), ("max_len", max_len, 1),
                                 ("n_kv_heads", n_kv_heads, 1), ("d_head", d_head, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                kind = "non-negative" if low == 0 else "positive"
                raise ValueError(f"{name} must be a {kind} int, got {value!r}")
        dtype = dtype or torch.get_default_dtype()
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"cache dtype must be a floating torch.dtype, got {dtype!r}")
        try:
            device = torch.device(device) if device is not None else None
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device must be a torch.device or a string such as 'cpu' or 'cuda:0', "
                             f"got {device!r}") from exc
        if device is not None and device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} was requested but CUDA is not available here")
        shape = (batch_size, n_kv_heads, max_len, d_head)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.batch_size, self.max_len, self.n_kv_heads, self.d_head = batch_size, max_len, n_kv_heads, d_head
        self._length = 0
        self._owner = None

    # TEMPORARY (replaced by the leaf branch's implementation at merge)
    @property
    def owner(self):
        return self._owner

    def claim(self, owner):
        if self._owner is None:
            self._owner = owner
        elif self._owner is not owner:
            raise ValueError("one cache per layer")

    def checkpoint(self, n):
        end = min(self._length + n, self.max_len)
        return (self._length, self.keys[:, :, self._length:end].clone(), self.values[:, :, self._length:end].clone())

    def restore(self, saved):
        length, k, v = saved
        with torch.no_grad():
            self.keys[:, :, length:length + k.shape[2]].copy_(k)
            self.values[:, :, length:length + v.shape[2]].copy_(v)
        self._length = length

    @property
    def length(self) -> int:
        """Number of positions written so far (the next write starts here)."""
        return self._length

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value buffers."""
        return self.keys.nbytes + self.values.nbytes

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    def reset(self) -> None:
        """Forget every cached position (the buffers are kept; stale values are never read)."""
        self._length = 0

    def check_update(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise, without writing, if ``k``/``v`` cannot be appended."""
        for name, t in (("keys", k), ("values", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"cache {name} must be a torch.Tensor, got {type(t).__name__}")
        expected = (self.batch_size, self.n_kv_heads, k.shape[-2] if k.dim() == 4 else -1, self.d_head)
        for name, t in (("keys", k), ("values", v)):
            if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (expected[0], expected[1], expected[3]):
                raise ValueError(
                    f"cache {name} must have shape (b={self.batch_size}, h_kv={self.n_kv_heads}, s, "
                    f"d_h={self.d_head}), got {tuple(t.shape)}"
                )
            if t.dtype != self.keys.dtype:
                raise TypeError(f"cache holds {self.keys.dtype}, got {name} of dtype {t.dtype}")
            if t.device != self.keys.device:
                raise ValueError(f"cache is on {self.keys.device}, got {name} on {t.device}")
        if k.shape[-2] != v.shape[-2]:
            raise ValueError(f"keys and values must have the same length, got {k.shape[-2]} and {v.shape[-2]}")
        if self._length + k.shape[-2] > self.max_len:
            raise ValueError(
                f"cache overflow: {self._length} cached + {k.shape[-2]} new > max_len={self.max_len}; "
                f"allocate a larger cache or reset() it"
            )

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new keys/values; return views of everything cached so far (no copy).

        Shapes:
            k, v: (b, h_kv, s, d_h) -> (b, h_kv, length + s, d_h) each
        """
        self.check_update(k, v)
        start, end = self._length, self._length + k.shape[-2]
        with torch.no_grad():
            self.keys[:, :, start:end].copy_(k)
            self.values[:, :, start:end].copy_(v)
        self._length = end
        return self.keys[:, :, :end], self.values[:, :, :end]  # (b, h_kv, length, d_h)

    def __repr__(self) -> str:
        return (f"KVCache(batch_size={self.batch_size}, max_len={self.max_len}, n_kv_heads={self.n_kv_heads}, "
                f"d_head={self.d_head}, length={self._length}, dtype={self.keys.dtype})")
