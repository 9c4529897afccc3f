"""Decode steps bound to a layer and its cache: ``step = DecodeStep(attn, cache)``.

A :class:`DecodeStep` is the layer's cached forward bound to its cache: ``step(x)`` is ``attn(x, cache=cache)``.
At construction it checks that the layer decodes self-attention and that the cache fits it and belongs to it,
so a misfit is refused where the loop is set up, not at its first token. The forward itself then takes the
short route for one token on a plain layer (:mod:`headwise.token_step`: checks that can change between calls
only, the plan of a one-query step made once per cache) and the general route for everything else (several
tokens, hooks, a trace, a wrapped projection, ...). Under ``torch.compile`` the layer writes at the cache's
device position and reads the whole buffer under a position mask, so one graph serves every position:
``torch.compile(DecodeStep(attn, cache), mode="reduce-overhead", fullgraph=True)`` records one CUDA graph.

Shapes:
    b: batch, d: model width (d_model).
    x: (b, s, d) -> (b, s, d)
"""

from __future__ import annotations

import torch

from .attention import MultiHeadAttention
from .kv_cache import KVCache
from .module_calls import calls_forward_only
from .token_step import one_token
from .validation import check_step_cache

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
        w = attn.q_proj.weight
        check_step_cache(cache, w.dtype, w.device)
        cache.claim(attn)  # raises, binding nothing, if the cache is another layer's
        self.layer, self.cache = attn, cache
        self._plain_class = type(attn) is MultiHeadAttention  # a subclass may override any step of the forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The next token(s) through the layer: ``attn(x, cache=cache)``.

        Args:
            x: the new tokens' inputs, (b, s, d).
        """
        attn, cache = self.layer, self.cache
        if self._plain_class and calls_forward_only(attn):  # the forward's own first step, without the module call
            y = one_token(attn, x, cache)
            if y is not None:
                return y
        return attn(x, cache=cache)

    def __repr__(self) -> str:
        return f"DecodeStep({self.layer.extra_repr()}, cache={self.cache!r})"
