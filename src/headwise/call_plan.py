"""The plan of one call of a layer: its inputs checked, then every decision made by
:func:`~headwise.plan.plan_attention`.

:class:`~headwise.MultiHeadAttention` plans each call here, from the layer's settings (config, mode, backend,
chunking) and the call's checked inputs: :func:`plan_forward` for ``forward`` and ``explain_dispatch`` (the same
plan, so the explanation is of what runs), :func:`plan_attend` for ``attend`` called on split heads. Both
plan for the layer's active ``headwise.trace`` (:func:`traced`) and for the dtype the attention runs in (the
autocast dtype under ``torch.autocast``). The functions read the layer through its public attributes only.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width (d_model), d_h: head width (d_head).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from .config import check_dropout, check_scale
from .dispatch import DispatchInfo, describe
from .masks import validate_mask
from .module_calls import has_forward_hooks
from .plan import STATISTICS, CacheRead, Plan, cache_read, plan_attention
from .statistics import check_statistics
from .validation import (autocast_dtype, check_bool, check_causal, check_first_write, check_forward, check_sinks,
                         has_dead_rows)

__all__ = ["plan_forward", "plan_attend", "explain_forward", "traced"]


def traced(layer: Any, tracer: Any, return_weights: bool,
           statistics: tuple[str, ...] = ()) -> tuple[bool, tuple[str, ...]]:
    """What a call of ``layer`` computes inside ``tracer``, its active ``headwise.trace``: the weights where the
    trace captures or edits the pattern, and the statistics it captures beside ``statistics``; returns
    ``(return_weights, statistics)``, the statistics in :data:`STATISTICS` order. Outside a trace the caller's
    own stand (callers ask only inside one: a default call runs no extra function)."""
    wanted = tracer.wants_statistics(layer)
    return (return_weights or tracer.wants_weights(layer),
            tuple(n for n in STATISTICS if n in statistics or n in wanted))


def plan_forward(layer: Any, x: torch.Tensor, key: torch.Tensor | None, mask: torch.Tensor | None, causal: bool,
                 cache: Any, return_weights: bool, *, backend: str, chunk_queries: bool | int,
                 statistics: tuple[str, ...] = (), value: torch.Tensor | None = None) -> Plan:
    """The plan of ``layer.forward`` on inputs ``check_forward`` returned.

    Args:
        layer: the ``MultiHeadAttention``.
        x: the queries' inputs (b, s_q, d); key: the keys' inputs (b, s_kv, kdim), None for self-attention.
        mask: the checked 4-D mask or None; causal: as given.
        cache: the layer's ``KVCache`` or None.
        return_weights: weights wanted by the caller (a trace's are added here).
        backend: the layer's backend; chunk_queries: its chunking setting (off inside a trace, and whenever
            q_proj or out_proj has forward hooks: decided here).
        statistics: per-head statistics wanted besides those of the layer's trace.
    """
    cfg = layer.config
    tracer = layer.tracer
    if tracer is not None:  # a trace captures and edits each call's heads whole: one pass
        return_weights, statistics = traced(layer, tracer, return_weights, statistics)
        chunk_queries = False
    # Under torch.autocast the projections write the autocast dtype: the attention runs in it, not in x's. The
    # helper is asked only while autocast is on here, so a default call runs no extra function.
    dtype, kind = x.dtype, x.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        dtype = autocast_dtype(dtype, x.device) or dtype
    # Autograd records the call only if something in it can take a gradient (a frozen layer chunks); a floating
    # mask can (a learned bias).
    grad = False
    if torch.is_grad_enabled():
        grad = x.requires_grad or (key is not None and key.requires_grad) or (mask is not None and mask.requires_grad) \
            or (value is not None and value.requires_grad)
        for p in layer.parameters():  # a plain loop: no generator frame on every call
            if grad:
                break
            grad = p.requires_grad
    read = CacheRead.NONE
    if cache is None:
        s_kv = x.shape[1] if key is None else key.shape[1]
    else:
        # Weights and statistics span the written keys only (a compiled call's alone span max_len).
        read = cache_read(kind, dtype, x.shape[1], mask is not None,
                          return_weights or bool(statistics) or backend == "eager" or grad, lambda: cache.length)
        whole = read is CacheRead.BUFFER or read is CacheRead.POSITION
        s_kv = cache.max_len if whole else cache.length + x.shape[1]
    sizes = dict(
        h=cfg.n_heads, h_kv=cfg.n_kv_heads, d_h=cfg.d_head, scale=cfg.scale, b=x.shape[0], s_q=x.shape[1],
        s_kv=s_kv, dtype=dtype, device=x.device, backend=backend, causal=causal,
        has_mask=mask is not None or read is CacheRead.BUFFER or read is CacheRead.POSITION,
        cached=cache is not None, return_weights=return_weights,
        dropout_p=cfg.dropout if layer.training else 0.0, records_grad=grad,
        dead_rows=False if mask is None else partial(has_dead_rows, mask),
        mask_per_head=mask is not None and mask.shape[1] != 1, read=read, statistics=statistics)
    plan = plan_attention(chunk_queries=chunk_queries, **sizes)
    # Chunks call q_proj and out_proj once per chunk on its rows: hooks on them (own or global) must see every
    # row in one call, so such a layer is not chunked (checked only where the plan chunks: long no-grad calls).
    if plan.chunk is not None and (has_forward_hooks(layer.q_proj) or has_forward_hooks(layer.out_proj)):
        return plan_attention(chunk_queries=False, **sizes)._replace(hooked=True)
    return plan


def plan_attend(layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None,
                causal: Any, return_weights: Any, scale: Any, softcap: Any, sinks: Any, dropout: Any,
                head_scale: Any, tracer: Any, backend: str) -> tuple[Plan, torch.Tensor | None]:
    """Check the arguments of ``layer.attend`` beside q, k, v (which the caller checked) and plan the call;
    returns the plan and the mask as a validated 4-D mask (or None).

    Args:
        layer: the ``MultiHeadAttention``; tracer: its active trace or None; backend: its backend.
        q, k, v, mask, causal, return_weights, scale, softcap, sinks, dropout, head_scale: as given to ``attend``.
    """
    cfg = layer.config
    if not (isinstance(causal, bool) and isinstance(return_weights, bool)):
        check_causal(causal)
        check_bool("return_weights", return_weights)
    b, h, s_q, _ = q.shape
    if scale is not None:
        check_scale(scale)
    if softcap is not None:
        check_scale(softcap, "softcap")
    if dropout is None:
        dropout = cfg.dropout if layer.training else 0.0
    elif dropout:
        check_dropout(dropout)
    if sinks is not None:
        check_sinks(sinks, b, h, s_q, q.device)
    if head_scale is not None and (not isinstance(head_scale, torch.Tensor) or head_scale.shape != (h,)):
        raise ValueError(f"attend: head_scale must be a tensor of one factor per head, shape ({h},), got "
                         f"{tuple(head_scale.shape) if isinstance(head_scale, torch.Tensor) else head_scale}")
    if mask is not None:
        mask = validate_mask(mask, (b, h, s_q, k.shape[2]), q.dtype, q.device)
    wants, stats = (return_weights, ()) if tracer is None else traced(layer, tracer, return_weights)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (sinks is not None and sinks.requires_grad))
    plan = plan_attention(
        h=h, h_kv=k.shape[1], d_h=q.shape[-1], scale=cfg.scale if scale is None else float(scale), b=b,
        s_q=s_q, s_kv=k.shape[2], dtype=q.dtype, device=q.device,
        backend="eager" if wants else backend, causal=causal, has_mask=mask is not None,
        return_weights=wants, dropout_p=float(dropout), chunk_queries=False, records_grad=grad,
        softcap=softcap, sinks=sinks is not None,
        dead_rows=False if mask is None else partial(has_dead_rows, mask),
        mask_per_head=mask is not None and mask.shape[1] != 1, statistics=stats)
    return plan, mask


def explain_forward(layer: Any, x: torch.Tensor, *, context: torch.Tensor | None, mask: torch.Tensor | None,
                    causal: bool, cache: Any, return_weights: bool, warn_bytes: int | None,
                    statistics: tuple[str, ...], key: torch.Tensor | None = None,
                    value: torch.Tensor | None = None) -> DispatchInfo:
    """``layer.explain_dispatch(...)``: the forward's checks and plan on these inputs, formatted; nothing is
    computed and no cache is bound.

    Args:
        layer: the ``MultiHeadAttention``.
        x, context, key, value, mask, causal, cache, return_weights: as given to its forward.
        warn_bytes: warn above this many bytes of probabilities (None: ``headwise.dispatch.WARN_BYTES``).
        statistics: per-head statistics a trace would capture.
    """
    if warn_bytes is not None and (isinstance(warn_bytes, bool) or not isinstance(warn_bytes, int)):
        raise TypeError(f"warn_bytes must be None or an int (bytes), got {type(warn_bytes).__name__} {warn_bytes!r}")
    if warn_bytes is not None and warn_bytes < 0:
        raise ValueError(f"warn_bytes must be None or a non-negative int (bytes), got {warn_bytes}")
    w = layer.q_proj.weight
    x, key, value, mask, _, _ = check_forward(layer.config, w.dtype, w.device, layer.rotary is not None, x,
                                              context, key, value, mask, causal, cache, None, return_weights)
    if cache is not None:
        if cache.owner is not None:
            cache.claim(layer)  # only checks: explaining never binds a cache
        # What the write would refuse (the dtype written under autocast, room for the call), as forward does.
        check_first_write(cache, x.shape[1], w.dtype, w.device)
    plan = plan_forward(layer, x, key, mask, causal, cache, return_weights, backend=layer.backend,
                        chunk_queries=layer.chunk_queries, statistics=check_statistics(statistics), value=value)
    cfg = layer.config
    dtype = autocast_dtype(w.dtype, w.device) or w.dtype  # the attention's, as plan_forward plans it
    return describe(plan, d_head=cfg.d_head, n_kv_heads=cfg.n_kv_heads, dtype=dtype, device=w.device,
                    mask=mask, grad=torch.is_grad_enabled(), causal_given=causal,
                    cache_length=0 if cache is None else cache.length, warn_bytes=warn_bytes)
