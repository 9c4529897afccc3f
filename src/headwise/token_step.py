"""One token through a layer: the short routes of the commonest decode calls.

``attn(x, cache=cache)`` with one new token and nothing else asked (no mask, positions, weights or
context) on a plain layer is what a decoding loop calls at every position, and on small layers its cost is
the Python around three products and one SDPA call. :func:`one_token`, which the forward (and
:class:`~headwise.DecodeStep`) calls first, takes that call with only the checks that can change between calls
(the token's shape, dtype and device; the layer's trace, backend, mode and projections) and with the plan of a
one-query step over that cache made once, not per token: a one-query step depends on the position only
through the key length, which it never needs (one query reads every cached key, so no causal mask). Every other call, and every call this route
does not recognise as plain, takes the general forward, which also refuses bad input with its messages. The
route computes what the general forward computes, with the same kernels, in the same order.

:func:`one_query_plan` is the same idea for :meth:`~headwise.MultiHeadAttention.attend` called on split heads by a
model's own decoding loop (a patched Hugging Face module at every token): one query over two or more keys, no
mask, weights, sinks, softcap or head scale. Such a call depends on its key count only through "two or more"
(no causal mask, no dead rows, cuDNN avoided for half precision on CUDA: plan rules 3-6), so the plan of a layer's
first such call serves its later ones while every other input of :func:`~headwise.plan.plan_attention` is the
same; ``attend`` still checks q, k and v at every call.

Shapes:
    b: batch, d: model width (d_model), h: query heads, h_kv: key/value heads, d_h: head width.
    x: (b, 1, d) -> (b, 1, d)
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import functional as hwf
from .config import check_scale
from .kv_cache import KVCache
from .module_calls import FORWARD_STEPS, has_forward_hooks
from .plan import CacheRead, Plan, cache_read, plan_attention

__all__ = ["PLAN_KEY", "QUERY_PLAN_KEY", "one_token", "one_query_plan"]

#: Where :func:`one_token` keeps a layer's one-token plan, in the layer's ``__dict__`` (a layer drops it from
#: copies and pickles): (config, weak reference to the cache, dtype, device, plan).
PLAN_KEY = "headwise_token_plan"
#: Where :func:`one_query_plan` keeps a layer's last one-query plan, in the layer's ``__dict__``: (key, plan).
QUERY_PLAN_KEY = "headwise_query_plan"


def one_token(layer: Any, x: Any, cache: Any) -> torch.Tensor | None:
    """``layer(x, cache=cache)`` for one token of a plain self-attention layer, or None where the general
    forward must run (or refuse). ``layer`` is a ``MultiHeadAttention`` of that very class (a subclass may
    override any step), called without mask, positions, weights or context. Attributes are read from the
    modules' own dictionaries: at one token a call's fixed cost is mostly attribute lookups.

    Args:
        layer: the layer.
        x: the new token's inputs, (b, 1, d) (anything else: None).
        cache: the layer's :class:`~headwise.KVCache` (anything else: None).
    """
    state = layer.__dict__
    if not (type(x) is torch.Tensor and layer.tracer is None and state["_backend"] == "sdpa"
            and layer.rotary is None and not (state["training"] and state["config"].dropout)) \
            or torch.compiler.is_compiling():
        return None  # compiled: the general forward writes at the device position (one graph for all)
    if not state.keys().isdisjoint(FORWARD_STEPS):
        return None  # a step assigned on the instance (a notebook's monkeypatch) must run
    modules = state["_modules"]
    q_proj, k_proj, v_proj, out_proj = modules["q_proj"], modules["k_proj"], modules["v_proj"], modules["out_proj"]
    for p in (q_proj, k_proj, v_proj, out_proj):
        if type(p) is not nn.Linear or "forward" in p.__dict__ or has_forward_hooks(p):
            return None  # a wrapped, reassigned or hooked projection (own or global hooks): its call must run
    cfg = state["config"]
    memo = state.get(PLAN_KEY)
    if memo is None or memo[0] is not cfg or memo[1]() is not cache:
        memo = _plan(layer, cache)
        if memo is None:
            return None
    _, _, dtype, device, plan = memo
    b, d, h, h_kv, d_h = cache.batch_size, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    w_q = q_proj._parameters["weight"]
    if x.shape != (b, 1, d) or x.dtype is not dtype or w_q.dtype is not dtype or x.device != device \
            or w_q.device != device:
        return None
    # The products take x as nn.Linear gets it in the general forward, (b, 1, d) with its own strides: a (b, d)
    # view may take another kernel (a sliced x[:, t:t + 1], half precision) and round otherwise.
    q = F.linear(x, w_q, q_proj._parameters["bias"]).view(b, h, 1, d_h)  # (b, h, 1, d_h): a view
    k = F.linear(x, k_proj._parameters["weight"], k_proj._parameters["bias"]).view(b, h_kv, 1, d_h)
    v = F.linear(x, v_proj._parameters["weight"], v_proj._parameters["bias"]).view(b, h_kv, 1, d_h)
    if q.requires_grad or k.requires_grad:
        return None  # autograd records the step: the general forward reads copies, the new key's history kept
    start = cache.length
    k, v = cache.update(k, v)  # (b, h_kv, length, d_h); an overflow raises before anything is written
    try:
        mask = None
        if plan.cache_read is CacheRead.BUFFER:  # the whole buffer: one shape at every position (plan rule 8)
            k, v, mask = cache.keys, cache.values, cache.read_mask(1)  # (b, h_kv, max_len, d_h), (1, 1, 1, max_len)
        z, _ = hwf.attend(plan, q, k, v, mask)  # (b, h, 1, d_h)
        # Merged as merge_heads merges (one token: the transpose moves nothing), then W_O as nn.Linear applies it.
        y = F.linear(z.reshape(b, 1, h * d_h), out_proj._parameters["weight"], out_proj._parameters["bias"])
    except BaseException:
        cache.crop(start)  # as the general forward does: a failed call leaves the cache's length as it was
        raise
    return y  # (b, 1, d): merged, then W_O


def _plan(layer: Any, cache: Any) -> tuple | None:
    """Check once that ``cache`` is this self-attention layer's and fits it, and plan a one-query step over it;
    keep both on the layer. None (nothing kept) where the general forward must decide."""
    cfg = layer.config
    if not isinstance(cache, KVCache) or cache.owner is not layer or not cfg.kdim == cfg.vdim == cfg.d_model \
            or (cache.n_kv_heads, cache.d_head) != (cfg.n_kv_heads, cfg.d_head):
        return None  # a first call binds the cache; a misfit gets the forward's message
    dtype, device = cache.keys.dtype, cache.keys.device  # a cache's buffers never change dtype or device
    read = cache_read(device.type, dtype, 1, False, False, lambda: cache.length)
    plan = plan_attention(
        h=cfg.n_heads, h_kv=cfg.n_kv_heads, d_h=cfg.d_head, scale=cfg.scale, b=cache.batch_size, s_q=1,
        s_kv=cache.max_len, dtype=dtype, device=device, cached=True, has_mask=read is CacheRead.BUFFER, read=read)
    memo = (cfg, weakref.ref(cache), dtype, device, plan)
    layer.__dict__[PLAN_KEY] = memo
    return memo


def one_query_plan(layer: Any, q: Any, k: Any, v: Any, causal: Any, scale: Any, dropout: Any) -> Plan | None:
    """The plan of ``layer.attend(q, k, v, causal=causal, scale=scale, dropout=dropout)`` for one query over two or
    more keys, the caller having ruled out a mask, weights, sinks, softcap, head scale and a trace; kept on the
    layer and reused while every input of ``plan_attention`` but the key count is the same (the plan's ``shape``
    records the call that made it). The caller has checked q, k, v (``check_qkv``). None where the general path
    must decide (or refuse).

    Args:
        layer: the ``MultiHeadAttention`` whose ``attend`` is called.
        q, k, v: the split heads.
        causal, scale, dropout: as given to ``attend``.
    """
    if q.shape[2] != 1 or k.shape[2] < 2 or not (causal is False or causal is True) \
            or torch.compiler.is_compiling():
        return None  # compiled: the memo is host state, not something to trace
    cfg = layer.config
    if dropout is None:
        if layer.training and cfg.dropout:  # an attribute: a view's mode is its host's
            return None
    elif type(dropout) is not float or dropout != 0.0:
        return None
    if scale is None:
        scale = cfg.scale
    elif type(scale) is not float:
        return None
    backend = layer.backend
    state = layer.__dict__
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    key = (q.shape, k.shape[1], q.dtype, q.device, scale, causal, backend, grad)
    memo = state.get(QUERY_PLAN_KEY)
    if memo is not None and memo[0] == key:
        return memo[1]
    check_scale(scale)
    b, h, _, d_h = q.shape
    plan = plan_attention(h=h, h_kv=k.shape[1], d_h=d_h, scale=scale, b=b, s_q=1, s_kv=k.shape[2], dtype=q.dtype,
                          device=q.device, backend=backend, causal=causal, chunk_queries=False, records_grad=grad)
    state[QUERY_PLAN_KEY] = (key, plan)
    return plan
