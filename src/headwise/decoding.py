"""One-token decode steps bound to a layer and its cache: ``step = DecodeStep(attn, cache)``.

A :class:`DecodeStep` is a convenience, not a second forward: ``step(x)`` is ``attn(x, cache=cache)``, so
hooks, a replaced config, swapped projections, a changed backend and a trace are honoured exactly as by the
forward. What it adds is checked once, at construction: the layer decodes self-attention and the cache
fits it and belongs to it.

Shapes:
    b: batch, d: model width (d_model), h: query heads, h_kv: key/value heads, d_h: head width.
    x: (b, 1, d) -> (b, 1, d)
"""

from __future__ import annotations

import torch

from .attention import MultiHeadAttention
from .kv_cache import KVCache

__all__ = ["DecodeStep"]


class DecodeStep:
    """``step(x)`` is ``attn(x, cache=cache)``: the forward itself, with the layer and cache checked once.

    Args:
        attn: a self-attention :class:`~headwise.MultiHeadAttention` (key and value widths = d_model).
        cache: its :class:`~headwise.KVCache` (claimed for ``attn`` here, as a forward would).

    Shapes:
        x: (b, s, d) with b = cache.batch_size -> (b, s, d)

    Example:
        >>> attn = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2).eval()
        >>> x = torch.randn(2, 6, 32)
        >>> cache = attn.new_cache(batch_size=2, max_len=8)
        >>> step = DecodeStep(attn, cache)
        >>> with torch.no_grad():
        ...     ys = [attn(x[:, :4], cache=cache)] + [step(x[:, t:t + 1]) for t in (4, 5)]
        ...     full = attn(x, causal=True)
        >>> torch.testing.assert_close(torch.cat(ys, dim=1), full)
    """

    def __init__(self, attn: MultiHeadAttention, cache: KVCache) -> None:
        if not isinstance(attn, MultiHeadAttention):
            raise TypeError(f"DecodeStep needs a MultiHeadAttention, got {type(attn).__name__}")
        if not isinstance(cache, KVCache):
            raise TypeError(f"DecodeStep needs a KVCache (see attn.new_cache), got {type(cache).__name__}")
        cfg = attn.config
        if not cfg.kdim == cfg.vdim == cfg.d_model:
            raise ValueError(f"DecodeStep decodes self-attention; this layer has kdim={cfg.kdim}, vdim={cfg.vdim}, "
                             f"d_model={cfg.d_model}")
        if (cache.n_kv_heads, cache.d_head) != (cfg.n_kv_heads, cfg.d_head):
            raise ValueError(f"the cache holds n_kv_heads={cache.n_kv_heads}, d_head={cache.d_head}; the layer has "
                             f"n_kv_heads={cfg.n_kv_heads}, d_head={cfg.d_head}")
        cache.claim(attn)  # raises, binding nothing, if the cache is another layer's
        self.layer, self.cache = attn, cache

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The next token(s) through the layer: ``attn(x, cache=cache)``.

        Args:
            x: the new tokens' inputs, (b, s, d).
        """
        return self.layer(x, cache=self.cache)

    def __repr__(self) -> str:
        return f"DecodeStep({self.layer.extra_repr()}, cache={self.cache!r})"
