"""Decode steps bound to a layer and its cache: ``step = DecodeStep(attn, cache)``.

A :class:`DecodeStep` is the layer's cached forward with the decisions taken once: ``step(x)`` equals
``attn(x, cache=cache)``. At construction it checks that the layer decodes self-attention and that the cache fits
it and belongs to it. Each call then takes one of two routes, both the forward's own math:

* **eager, one token, plain layer** (no hooks, no trace, no wrapped projections, not training with dropout):
  the projections, the cache write, one planned SDPA call and W_O, with only the checks that can change between
  calls (the token's shape, dtype and device; the layer's state). The plan for one query over the cache is made
  once and reused at every position: it depends on the position only through the key length, which a one-query
  step never needs (no causal mask: one query reads every cached key).
* **everything else** (several tokens, hooks, a trace, a LoRA-wrapped projection, ...): ``attn(x, cache=cache)``
  itself, so hooks, a replaced config, swapped projections, a changed backend and a trace are honoured exactly
  as by the forward. Under ``torch.compile`` this is the route too: the layer then writes at the cache's device
  position and reads the whole buffer under a position mask, so one graph serves every position.

Shapes:
    b: batch, d: model width (d_model), h: query heads, h_kv: key/value heads, d_h: head width.
    x: (b, 1, d) -> (b, 1, d)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import MultiHeadAttention, has_forward_hooks
from . import functional as hwf
from .kv_cache import KVCache
from .plan import CacheRead, Plan, cache_read, plan_attention

__all__ = ["DecodeStep"]


class DecodeStep:
    """``step(x)`` is ``attn(x, cache=cache)``: the forward itself, with the layer and cache checked once and a
    one-token step planned once.

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
        # Only the layer's own class has the forward the one-token route reproduces (a subclass may override it).
        self._plain_class = type(attn) is MultiHeadAttention
        self._plan_key: tuple | None = None  # (id(config), dtype, device) the plan below was made for
        self._plan: Plan | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The next token(s) through the layer: ``attn(x, cache=cache)``.

        Args:
            x: the new tokens' inputs, (b, s, d).
        """
        attn, cache = self.layer, self.cache
        if torch.compiler.is_compiling():  # traced: the forward's static-cache route (one graph, every position)
            return attn(x, cache=cache)
        y = self._one_token(attn, cache, x)
        return attn(x, cache=cache) if y is None else y

    def _one_token(self, attn: MultiHeadAttention, cache: KVCache, x: object) -> torch.Tensor | None:
        """The forward's answer for one token of a plain layer, or None where the forward itself must run.

        Everything that can change between calls is looked at (the input; the layer's hooks, trace, backend, mode
        and projections); the rest was checked when the step was built. Attributes are read from the modules'
        own dictionaries: a decode step's fixed cost is mostly attribute lookups."""
        if not (self._plain_class and type(x) is torch.Tensor and x.dim() == 3 and x.shape[1] == 1
                and attn.tracer is None and attn._backend == "sdpa" and attn.rotary is None
                and not (attn.training and attn.config.dropout) and not has_forward_hooks(attn)):
            return None
        modules = attn._modules
        q_proj, k_proj, v_proj, out_proj = modules["q_proj"], modules["k_proj"], modules["v_proj"], modules["out_proj"]
        for p in (q_proj, k_proj, v_proj, out_proj):
            if type(p) is not nn.Linear or p._forward_hooks or p._forward_pre_hooks:
                return None
        cfg = attn.config
        w_q = q_proj._parameters["weight"]
        b, d = x.shape[0], cfg.d_model
        keys = cache.keys
        if b != cache.batch_size or x.shape[2] != d or x.dtype != w_q.dtype or x.device != w_q.device \
                or keys.dtype != w_q.dtype or keys.device != w_q.device:
            return None  # the forward refuses it with the right message
        h, h_kv, d_h = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        plan = self._plan
        if self._plan_key != (id(cfg), x.dtype, x.device):  # planned once; the position never enters the plan
            read = cache_read(x.device.type, x.dtype, 1, False, False, lambda: cache.length)
            plan = self._plan = plan_attention(
                h=h, h_kv=h_kv, d_h=d_h, scale=cfg.scale, b=b, s_q=1, s_kv=cache.max_len, dtype=x.dtype,
                device=x.device, cached=True, has_mask=read is CacheRead.BUFFER, read=read)
            self._plan_key = (id(cfg), x.dtype, x.device)
        x2 = x.view(b, d)  # one token: (b, d), the projections' plain matrix product
        q = F.linear(x2, w_q, q_proj._parameters["bias"]).view(b, h, 1, d_h)  # (b, h, 1, d_h): a view
        k = F.linear(x2, k_proj._parameters["weight"], k_proj._parameters["bias"]).view(b, h_kv, 1, d_h)
        v = F.linear(x2, v_proj._parameters["weight"], v_proj._parameters["bias"]).view(b, h_kv, 1, d_h)
        start = cache.length
        k, v = cache.update(k, v)  # (b, h_kv, length, d_h); an overflow raises before anything is written
        mask = None
        if plan.cache_read is CacheRead.BUFFER:  # the whole buffer: one shape at every position (plan rule 8)
            k, v, mask = keys, cache.values, cache.read_mask(1)  # (b, h_kv, max_len, d_h), (1, 1, 1, max_len)
        try:
            z, _ = hwf.attend(plan, q, k, v, mask)  # (b, h, 1, d_h)
        except BaseException:
            cache.crop(start)  # as the forward does: a failed step leaves the cache's length as it was
            raise
        y = F.linear(z.reshape(b, h * d_h), out_proj._parameters["weight"], out_proj._parameters["bias"])
        return y.view(b, 1, d)  # (b, 1, d): merged, then W_O

    def __repr__(self) -> str:
        return f"DecodeStep({self.layer.extra_repr()}, cache={self.cache!r})"
