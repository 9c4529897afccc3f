"""The math of multi-head attention: split the heads, attend within each head, merge them back.

Pure functions of tensors (no modules, no parameters). :func:`attention` is the validated public entry;
:func:`attend` runs a :class:`~headwise.plan.Plan` on inputs its maker already validated (the layer's
forward). The eager path has one readable reference, :func:`_softmax_attention`, which is the formula; its
no-autograd speed variant, :func:`_softmax_attention_in_place`, sits beside it and is tested equal to it.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width (d_model), d_h: head width (d_head), g = h // h_kv: query heads per K/V head.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from .config import AttentionConfig
from .masks import causal_mask, combine_masks, validate_mask
from .plan import Plan, plan_attention
from .validation import check_bool, check_causal, check_qkv, check_tensor

__all__ = ["split_heads", "split_qkv", "merge_heads", "attention", "attend", "available_backends"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_BACKENDS = ("eager", "sdpa")


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Expose the head axis of a packed projection: a view, never a copy.

    The packed width ``h * d_h`` is reinterpreted as ``(h, d_h)`` (head ``i`` owns features
    ``i * d_h .. (i + 1) * d_h - 1``), then heads move in front of the sequence so each head's
    ``(s, d_h)`` block is what the kernels see.

    Shapes:
        x: (b, s, h * d_h) -> (b, h, s, d_h)

    Example:
        >>> x = torch.arange(2 * 3 * 8.).reshape(2, 3, 8)
        >>> y = split_heads(x, 2)
        >>> y.shape, y.data_ptr() == x.data_ptr()
        (torch.Size([2, 2, 3, 4]), True)
        >>> torch.equal(y[1, 1, 2], x[1, 2, 4:8])      # head 1 of token 2 is features 4..7
        True
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        check_tensor("x", x)
        raise ValueError(f"split_heads expects a packed projection (b, s, h * d_h), got {tuple(x.shape)}")
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads <= 0:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
    b, s, width = x.shape
    if width % n_heads:
        raise ValueError(f"cannot split width {width} into n_heads={n_heads} equal heads")
    return x.view(b, s, n_heads, width // n_heads).transpose(1, 2)  # (b, h, s, d_h)


def split_qkv(qkv: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split one fused Q/K/V projection into its query, key and value heads: one view for all of them.

    Every Q, K and V head is a ``d_h``-wide block of the fused width (queries first, then keys, then
    values), so the fused width splits into ``h + 2 h_kv`` heads at once and the head axis is then cut in
    three: the same views as splitting Q, K and V apart first, with fewer operations per call.

    Shapes:
        qkv: (b, s, (h + 2 * h_kv) * d_h) -> (b, h, s, d_h), (b, h_kv, s, d_h), (b, h_kv, s, d_h)

    Example:
        >>> qkv = torch.randn(2, 3, (4 + 2 * 2) * 8)
        >>> q, k, v = split_qkv(qkv, 4, 2)
        >>> q.shape, v.shape, torch.equal(k, split_heads(qkv[..., 32:48], 2))
        (torch.Size([2, 4, 3, 8]), torch.Size([2, 2, 3, 8]), True)
    """
    for name, n in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    heads = split_heads(qkv, n_heads + 2 * n_kv_heads)  # (b, h + 2 * h_kv, s, d_h)
    q, k, v = heads.split_with_sizes((n_heads, n_kv_heads, n_kv_heads), dim=1)
    return q, k, v


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_heads`: transpose back, then flatten heads into features.

    Flattening ``(b, h, s, d_h)`` without the transpose gives the right shape and the wrong tensor
    (token and head coordinates get mixed); this is the classic bug, so it lives in one place.

    Shapes:
        x: (b, h, s, d_h) -> (b, s, h * d_h)

    Example:
        >>> x = torch.randn(2, 3, 8)
        >>> torch.equal(merge_heads(split_heads(x, 2)), x)
        True
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        check_tensor("x", x)
        raise ValueError(f"merge_heads expects split heads (b, h, s, d_h), got {tuple(x.shape)}")
    b, h, s, d_h = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d_h)  # (b, s, h * d_h)


def _softmax_attention(q, k, v, mask, scale, dropout_p):  # type: ignore[no-untyped-def]
    """The reference: ``softmax(Q K^T * scale + mask) V`` for every head; query head i reads K/V head i // g.

    A row that may read nothing gets zero weights and a zero context (softmax of a finite row, then
    zeroed), so neither the forward nor the backward sees 0/0. Half precision runs in float32.
    """
    b, h, s_q, d_h = q.shape
    h_kv, s_kv = k.shape[1], k.shape[2]
    dtype = q.dtype
    if dtype in _LOW_PRECISION:  # half-precision scores of large inputs overflow
        q, k, v = q.float(), k.float(), v.float()
    q = q.reshape(b, h_kv, h // h_kv * s_q, d_h)  # (b, h_kv, g * s_q, d_h): a group's queries share K
    scores = (q @ k.transpose(-2, -1) * scale).view(b, h, s_q, s_kv)  # (b, h, s_q, s_kv)
    blocked = None
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        blocked = (scores == float("-inf")).all(-1, keepdim=True)  # (b, h, s_q, 1)
        scores = scores.masked_fill(blocked, 0.0)
    weights = torch.softmax(scores, dim=-1)
    if blocked is not None:
        weights = weights.masked_fill(blocked, 0.0)
    probs = F.dropout(weights, p=dropout_p, training=True) if dropout_p else weights
    z = probs.view(b, h_kv, h // h_kv * s_q, s_kv) @ v  # (b, h_kv, g * s_q, d_h)
    return z.view(b, h, s_q, v.shape[-1]).to(dtype), weights.to(dtype)  # (b, h, s_q, d_h)


def _softmax_attention_in_place(q, k, v, mask, scale, dropout_p):  # type: ignore[no-untyped-def]
    """:func:`_softmax_attention` without autograd, with its buffers reused: equal to it (tests/test_functional.py).

    Three tricks, each about memory traffic: the queries are scaled (one pass that also lays them out for
    the batched matmul, which would copy them anyway) instead of the ``s_kv / d_h`` times larger scores;
    a K whose (b, h_kv) axes cannot merge is copied row-wise once, rather than element by element inside the
    batched matmul (a cache slice merges and is never copied); the mask and the softmax write into the
    score buffer, so one (b, h, s_q, s_kv) tensor is allocated instead of two or three (a fresh buffer of
    that size costs about as much as the softmax, in page faults).
    """
    b, h, s_q, d_h = q.shape
    h_kv, s_kv = k.shape[1], k.shape[2]
    dtype = q.dtype
    if dtype in _LOW_PRECISION:
        q, k, v = q.float(), k.float(), v.float()
    q = torch.mul(q, scale, out=torch.empty(q.shape, dtype=q.dtype, device=q.device))
    if b > 1 and h_kv > 1 and k.stride(0) != h_kv * k.stride(1):
        k = k.contiguous()
    scores = (q.view(b, h_kv, h // h_kv * s_q, d_h) @ k.transpose(-2, -1)).view(b, h, s_q, s_kv)
    blocked = None
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else scores.add_(mask)
        blocked = (scores == float("-inf")).all(-1, keepdim=True)  # (b, h, s_q, 1)
        scores.masked_fill_(blocked, 0.0)
    weights = torch.softmax(scores, dim=-1, out=scores)
    if blocked is not None:
        weights.masked_fill_(blocked, 0.0)
    probs = F.dropout(weights, p=dropout_p, training=True) if dropout_p else weights
    z = probs.view(b, h_kv, h // h_kv * s_q, s_kv) @ v  # (b, h_kv, g * s_q, d_h)
    return z.view(b, h, s_q, v.shape[-1]).to(dtype), weights.to(dtype)  # (b, h, s_q, d_h)


def attend(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``plan``'s attention step: every head on its own, nothing shared between heads.

    Inputs are trusted (the plan's maker validated them; ``mask`` is already a validated 4-D mask). Use
    :func:`attention` for unvalidated tensors.

    Shapes:
        q: (b, h, s_q, d_h); k, v: (b, h_kv, s_kv, d_h); mask: broadcastable to (b, h, s_q, s_kv)
        -> context (b, h, s_q, d_h), weights (b, h, s_q, s_kv) on the eager path, else None
    """
    b, h, s_q, s_kv = plan.shape
    if plan.backend == "empty":
        weights = q.new_zeros(b, h, s_q, s_kv) if plan.return_weights else None
        return q.new_zeros(b, h, s_q, v.shape[-1]), weights
    if plan.causal_via == "explicit mask":
        mask = combine_masks(mask, causal_mask(s_q, s_kv, device=q.device))  # bottom-right
    if plan.backend == "eager":
        run = _softmax_attention_in_place if plan.in_place else _softmax_attention
        return run(q, k, v, mask, plan.scale, plan.dropout_p)
    if plan.fold_decode:
        h_kv, d_h = k.shape[1], q.shape[-1]
        z = F.scaled_dot_product_attention(q.reshape(b, h_kv, h // h_kv, d_h), k, v, dropout_p=plan.dropout_p,
                                           scale=plan.scale)  # (b, h_kv, g, d_h): one query row per head
        return z.reshape(b, h, 1, v.shape[-1]), None  # (b, h, 1, d_h)
    if plan.enable_gqa and not plan.cached:
        k, v = _own_rows(k), _own_rows(v)  # (b, h_kv, s_kv, d_h)
    z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=plan.dropout_p,
                                       is_causal=plan.is_causal, scale=plan.scale, enable_gqa=plan.enable_gqa)
    return z, None


def _own_rows(t: torch.Tensor) -> torch.Tensor:
    """K or V of a grouped layer with rows of their own width: CPU's flash kernel, whose query heads share
    each K/V head, reads K/V that are views into the wider packed Q/K/V product far slower (up to 1.4x the
    kernel's time at s 2048, h 32, h_kv 8) than a copy of them costs. A cache's rows are left alone.

    Shapes: (b, h_kv, s_kv, d_h) -> the same, rows (b, s_kv) of width h_kv * d_h"""
    if t.stride(2) <= t.shape[1] * t.shape[3]:
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)  # (b, h_kv, s_kv, d_h)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
    scale: float | None = None, dropout_p: float = 0.0, causal: bool = False, backend: str = "sdpa",
    return_weights: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention on split heads, validated: ``softmax(Q K^T * scale + mask) V`` for every head.

    Under GQA query head ``i`` reads K/V head ``i // g`` (K and V are never repeated in memory).
    ``causal`` is bottom-right aligned (see :mod:`headwise.masks`). A row that may read nothing gets a zero
    context (and zero weights). Empty queries or keys give an empty or zero context.

    Args:
        q, k, v: split heads.
        mask: bool (True = may attend) or floating (added to the scores); int masks are refused.
        scale: score scale (default ``1 / sqrt(d_h)``).
        dropout_p: dropout on the probabilities.
        causal: bottom-right causal masking.
        backend: ``"sdpa"`` (fused) or ``"eager"`` (materialises and returns the weights).
        return_weights: default: True exactly for the eager backend.

    Shapes:
        q: (b, h, s_q, d_h); k, v: (b, h_kv, s_kv, d_h) -> (b, h, s_q, d_h), weights (b, h, s_q, s_kv) or None

    Example:
        >>> q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
        >>> fused, _ = attention(q, k, v, causal=True)
        >>> eager, w = attention(q, k, v, causal=True, backend="eager")
        >>> torch.testing.assert_close(fused, eager)
        >>> w.shape, attention(torch.randn(2, 4, 0, 8), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))[0].shape
        (torch.Size([1, 4, 3, 3]), torch.Size([2, 4, 0, 8]))
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {list(_BACKENDS)}, got {backend!r}")
    check_qkv(q, k, v)
    check_causal(causal)
    return_weights = backend == "eager" if return_weights is None else return_weights
    check_bool("return_weights", return_weights)
    b, h, s_q, d_h = q.shape
    s_kv = k.shape[2]
    if mask is not None:
        mask = validate_mask(mask, (b, h, s_q, s_kv), q.dtype, q.device)
    cfg = _call_config(h, k.shape[1], d_h, scale, dropout_p)  # validates scale and dropout_p
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    plan = plan_attention(cfg, b=b, s_q=s_q, s_kv=s_kv, dtype=q.dtype, device=q.device, backend=backend,
                          causal=causal, has_mask=mask is not None, return_weights=return_weights,
                          dropout_p=dropout_p, chunk_queries=False, records_grad=lambda: grad)
    return attend(plan, q, k, v, mask)


@functools.lru_cache(maxsize=64)
def _remembered_config(h: int, h_kv: int, d_h: int, scale: float | None, dropout_p: float) -> AttentionConfig:
    return AttentionConfig(d_model=h * d_h, n_heads=h, n_kv_heads=h_kv, d_head=d_h, scale=scale, dropout=dropout_p)


def _call_config(h: int, h_kv: int, d_h: int, scale: Any, dropout_p: Any) -> AttentionConfig:
    """The configuration one :func:`attention` call plans with. Building (and validating) a config costs more
    than a decode step's attention, and patched models call this once per layer and token, so configs of
    plain Python numbers are remembered (a frozen dataclass: sharing is safe; a refused one is never stored)."""
    if type(scale) in (float, int, type(None)) and type(dropout_p) in (float, int):
        return _remembered_config(h, h_kv, d_h, scale, dropout_p)
    return AttentionConfig(d_model=h * d_h, n_heads=h, n_kv_heads=h_kv, d_head=d_h, scale=scale, dropout=dropout_p)


def available_backends() -> list[str]:
    """Names accepted by ``backend=``.

    Example:
        >>> available_backends()
        ['eager', 'sdpa']
    """
    return list(_BACKENDS)
