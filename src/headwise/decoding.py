"""One-token decode steps with the checks and the plan done once: ``step = DecodeStep(attn, cache)``.

``attn(x, cache=cache)`` validates its inputs and plans the call on every token. That fixed Python work is
larger at decode sizes than a microbenchmark shows: each token streams the weights and the cached keys and
values (tens to hundreds of MiB) through the CPU caches and evicts the interpreter's own data, so every
Python operation on the path then costs many times more (``python -m benchmarks.cold_python`` measures it;
docs/benchmarks.md has the numbers). A :class:`DecodeStep` checks the layer and the cache once, plans the
one-token call once (the plan of one query over a cache does not depend on how many positions are cached),
and per token checks only what can change between tokens. Then it runs the forward's own steps: project
and split, rotate, write the cache, attend, merge and project out.

Every call it is not built for goes to ``attn(x, cache=cache)`` unchanged, with the same result and the
same errors: another shape, dtype or device, autograd on, training mode, an active trace, a full cache,
the eager backend, ``torch.compile`` tracing.

Shapes:
    b: batch, d: model width (d_model), h: query heads, h_kv: key/value heads, d_h: head width.
    x: (b, 1, d) -> (b, 1, d)
"""

from __future__ import annotations

import torch

from . import functional as hwf
from .attention import MultiHeadAttention
from .kv_cache import KVCache
from .plan import plan_attention

__all__ = ["DecodeStep"]


class DecodeStep:
    """``step(x)`` equals ``attn(x, cache=cache)`` for one new token per call, with less work per token.

    Built once per layer and cache (the cache is claimed for ``attn``, as a forward would). If a step fails
    after its cache write, the cache is cropped back to the length it had, as in the forward.

    Args:
        attn: a self-attention :class:`~headwise.MultiHeadAttention` (key and value widths = d_model).
        cache: its :class:`~headwise.KVCache`.

    Shapes:
        x: (b, 1, d) with b = cache.batch_size -> (b, 1, d)

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
        w = attn.q_proj.weight
        self.layer, self.cache = attn, cache
        self._shape = torch.Size((cache.batch_size, 1, cfg.d_model))
        self._dtype, self._device = w.dtype, w.device
        # Calls the forward would plan otherwise (or refuse) always take it.
        self._fast = attn.backend == "sdpa" and cache.dtype == w.dtype and cache.keys.device == w.device
        self._plan = plan_attention(cfg, b=cache.batch_size, s_q=1, s_kv=cache.max_len, dtype=w.dtype,
                                    device=w.device, backend="sdpa", cached=True, chunk_queries=False,
                                    records_grad=lambda: False)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """One token through the layer: ``attn(x, cache=cache)``.

        Args:
            x: the new token's inputs, (b, 1, d).
        """
        attn, cache = self.layer, self.cache
        start = cache.length
        if (not self._fast or type(x) is not torch.Tensor or x.shape != self._shape or x.dtype != self._dtype
                or x.device != self._device or torch.is_grad_enabled() or attn.training or attn.tracer is not None
                or start >= cache.max_len or attn.q_proj.weight.dtype != self._dtype
                or torch.compiler.is_compiling()):
            return attn(x, cache=cache)
        q, k, v = attn.project_qkv(x)  # (b, h, 1, d_h), (b, h_kv, 1, d_h), (b, h_kv, 1, d_h)
        if attn.rotary is not None:
            q, k = attn.rotate(q, k, torch.arange(start, start + 1, device=x.device))
        keys, values = cache.update(k, v)  # (b, h_kv, start + 1, d_h): everything cached so far
        try:
            z, _ = hwf.attend(self._plan, q, keys, values)  # (b, h, 1, d_h)
        except BaseException:
            cache.crop(start)  # as the forward does: the positions it reads are as before
            raise
        return attn.project_out(z)  # (b, 1, d)

    def __repr__(self) -> str:
        return f"DecodeStep({self.layer.extra_repr()}, cache={self.cache!r})"
