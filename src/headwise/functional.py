"""The math of multi-head attention: split the heads, attend within each head, merge them back.

Pure functions of tensors (no modules, no parameters). :func:`attention` is the validated public entry;
:func:`attend` runs a :class:`~headwise.plan.Plan` on inputs its maker validated (the layer's forward). The
eager path is one function, :func:`softmax_attention`: the formula, written out, and the reference every
fused path is tested against.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width (d_model), d_h: head width (d_head); d_v: value width (d_h unless a family says otherwise),
    g = h // h_kv: query heads per K/V head.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from .masks import causal_mask, combine_masks, open_dead_rows, validate_mask
from .plan import Causal, Grouping, Plan, plan_attention
from .config import check_dropout, check_scale
from .validation import check_bool, check_causal, check_qkv, check_sinks, check_tensor, has_dead_rows

__all__ = ["split_heads", "split_qkv", "merge_heads", "attention", "attend", "softmax_attention",
           "available_backends"]

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
    """Split one fused Q/K/V projection (queries first, then keys, then values) into its heads: views.

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


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                      dropout_p: float = 0.0, softcap: float | None = None, sinks: torch.Tensor | None = None,
                      causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula, for every head: ``softmax(cap(Q K^T * scale) + mask) V``; query head i reads K/V head i // g.

    ``softcap`` bounds each score to ``(-softcap, softcap)`` with ``softcap * tanh(score / softcap)``
    before the mask (Gemma 2). ``sinks`` adds one logit per query row that the row may "attend" to and that
    carries no value: one per head shared by every row (gpt-oss), or one per row (Inkling 2 computes them from
    the input). It takes part in the softmax and is dropped after it. A row that may
    read nothing gets zero weights and a zero context (softmax of a finite row, then zeroed), so neither
    the forward nor the backward sees 0/0. ``causal`` adds bottom-right causal masking (query i sits at
    position ``s_kv - s_q + i``). With ``dropout_p`` the weights returned are those after dropout, the ones the
    context is made of (as ``nn.MultiheadAttention`` and transformers' eager attention return them). Half
    precision runs in float32. Inputs are trusted.

    Shapes:
        q: (b, h, s_q, d_h); k: (b, h_kv, s_kv, d_h); v: (b, h_kv, s_kv, d_v); mask: 4-D, broadcastable
        to (b, h, s_q, s_kv); sinks: (h,), or 4-D broadcastable to (b, h, s_q, 1)
        -> context (b, h, s_q, d_v), weights (b, h, s_q, s_kv)
    """
    b, h, s_q, d_h = q.shape
    h_kv, s_kv = k.shape[1], k.shape[2]
    dtype = q.dtype
    if dtype in _LOW_PRECISION:  # half-precision scores of large inputs overflow
        q, k, v = q.float(), k.float(), v.float()
    g = h // h_kv
    # unflatten/flatten, and an einsum for probs @ V when traced, rather than views that fold (g * s_q) out of
    # the scores or the probabilities: under torch.export's dynamic shapes those views add guards that pin the
    # sequence length
    q_scale = scale if softcap is None else scale / softcap  # the softcap's division: one pass over the scores fewer
    q = (q * q_scale).reshape(b, h_kv, g * s_q, d_h)  # (b, h_kv, g * s_q, d_h): a group's queries share K
    scores = (q @ k.transpose(-2, -1)).unflatten(2, (g, s_q)).flatten(1, 2)  # (b, h, s_q, s_kv)
    if softcap is not None:
        scores = torch.tanh(scores) * softcap
    # Rows that may read nothing (possible only under a given mask, or causal with s_kv < s_q) are found on the
    # mask's own broadcast shape, usually without a head axis, never on the scores: they read everything
    # here, so the softmax stays finite, and their weights are zeroed after it. A bool mask becomes additive
    # on that small shape: one pass over the scores, as an additive mask costs.
    may_block = mask is not None or (causal and s_kv < s_q)
    if causal:
        mask = combine_masks(mask, causal_mask(s_q, s_kv, device=scores.device))  # (.., s_q, s_kv)
    blocked = None
    if mask is not None:
        if may_block:
            mask, blocked = open_dead_rows(mask)  # blocked: (b or 1, h or 1, s_q, 1)
        if mask.dtype == torch.bool:  # additive on the mask's small shape: one pass over the scores
            mask = torch.where(mask, scores.new_zeros(()), float("-inf"))  # (.., s_q, s_kv) in the scores' dtype
        scores = scores + mask
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        sink = (sinks.view(1, h, 1, 1) if sinks.dim() == 1 else sinks).to(scores.dtype).expand(b, h, s_q, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :s_kv]  # (b, h, s_q, s_kv)
    if blocked is not None:
        weights = weights * (~blocked).to(weights.dtype)  # (b, h, s_q, s_kv): rows that read nothing
    probs = F.dropout(weights, p=dropout_p, training=True) if dropout_p else weights
    if g == 1:
        z = probs @ v  # (b, h, s_q, d_v)
    elif torch.compiler.is_compiling():  # the einsum keeps the sequence length free under export (see above)
        z = torch.einsum("bngqk,bnkd->bngqd", probs.unflatten(1, (h_kv, g)), v).flatten(1, 2)  # (b, h, s_q, d_v)
    else:  # the same batched product without einsum's per-call cost
        z = probs.unflatten(1, (h_kv, g)).flatten(2, 3) @ v  # (b, h_kv, g * s_q, d_v): a group's rows share V
        z = z.unflatten(2, (g, s_q)).flatten(1, 2)  # (b, h, s_q, d_v)
    return z.to(dtype), probs.to(dtype)  # after dropout: the weights z is made of (as torch's and HF's)


def attend(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``plan``'s attention step: every head on its own, nothing shared between heads.

    Shapes and dtypes are trusted (the plan's maker validated them, and ``mask`` is a validated 4-D mask);
    only the mask's kind is checked here, because a mask of another dtype would be added silently. Use
    :func:`attention` for unvalidated tensors.

    Shapes:
        q: (b, h, s_q, d_h); k: (b, h_kv, s_kv, d_h); v: (b, h_kv, s_kv, d_v); mask: 4-D, broadcastable
        to (b, h, s_q, s_kv); sinks: as :func:`softmax_attention` -> context (b, h, s_q, d_v), weights (eager
        path) or None
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a headwise.plan.Plan (from plan_attention), got {type(plan).__name__}; "
                        f"use headwise.functional.attention for tensors alone")
    if mask is not None and mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(f"mask must be bool (True = may attend) or floating (added to the scores), got {mask.dtype}")
    b, h, s_q, s_kv = plan.shape
    if plan.backend == "empty":
        # Products over an empty axis: exact zeros (a sum of nothing, never NaN) that stay in the autograd graph
        # of q, k and v, so the input and every weight get an empty or zero gradient, as torch's layers give.
        k, v = k[:, :, :s_kv], v[:, :, :s_kv]  # the keys the plan reads: none when s_kv = 0
        scores = q.unflatten(1, (k.shape[1], -1)) @ k.unsqueeze(2).transpose(-1, -2)  # (b, h_kv, g, s_q, s_kv)
        z = (scores @ v.unsqueeze(2)).flatten(1, 2)  # (b, h, s_q, d_v)
        if sinks is not None:  # a sum over none of them: 0, so the sinks (a parameter) get a zero gradient too
            z = z + sinks.flatten()[:0].sum()
        return z, scores.flatten(1, 2) if plan.return_weights else None  # (b, h, s_q, s_kv): always empty
    if plan.backend == "eager":
        return softmax_attention(q, k, v, mask, plan.scale, plan.dropout_p, plan.softcap, sinks,
                                 causal=plan.causal_via is Causal.MASK)
    if plan.causal_via is Causal.MASK:
        mask = combine_masks(mask, causal_mask(s_q, s_kv, device=q.device))  # bottom-right
    dead = None
    if plan.zero_dead_rows:  # zeros by headwise, whatever the kernel gives a row that reads nothing
        mask, dead = open_dead_rows(mask)  # dead: (b or 1, h or 1, s_q, 1)
    grouping = plan.grouping
    if grouping is Grouping.FOLD:  # one query: a group's query heads are rows of its K/V head
        q = q.reshape(b, k.shape[1], h // k.shape[1], q.shape[-1])  # (b, h_kv, g, d_h)
    elif grouping is Grouping.REPEAT:
        k = k.repeat_interleave(h // k.shape[1], dim=1)  # (b, h, s_kv, d_h)
        v = v.repeat_interleave(h // v.shape[1], dim=1)  # (b, h, s_kv, d_v)
    if plan.avoid_cudnn and torch.backends.cuda.cudnn_sdp_enabled():
        # For this call only (plan rule 6), through PyTorch's own switch: the other kernels stay as the user set
        # them, and this costs two flag writes where a sdpa_kernel context costs a decode step's worth of Python.
        torch.backends.cuda.enable_cudnn_sdp(False)
        try:
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=plan.dropout_p,
                                               is_causal=plan.causal_via is Causal.KERNEL, scale=plan.scale,
                                               enable_gqa=grouping is Grouping.KERNEL)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(True)
    else:
        z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=plan.dropout_p,
                                           is_causal=plan.causal_via is Causal.KERNEL, scale=plan.scale,
                                           enable_gqa=grouping is Grouping.KERNEL)
    if grouping is Grouping.FOLD:
        z = z.reshape(b, h, 1, v.shape[-1])  # (b, h, 1, d_v): one query row per head
    if dead is not None:
        z = z.masked_fill(dead, 0.0)
    return z, None


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
    scale: float | None = None, dropout_p: float = 0.0, causal: bool = False, backend: str = "sdpa",
    return_weights: bool | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention on split heads, validated: ``softmax(Q K^T * scale + mask) V`` for every head.

    Under GQA query head ``i`` reads K/V head ``i // g`` (K and V are repeated in memory only on CUDA, where the
    best fused kernel for the inputs cannot group heads: see :mod:`headwise.plan`, rule 5).
    ``causal`` is bottom-right aligned (see :mod:`headwise.masks`). A row that may read nothing gets a zero
    context (and zero weights). Empty queries or keys give an empty or zero context. Values may be wider
    or narrower than queries and keys (``d_v != d_h``, as in DeepSeek's MLA).

    Args:
        q, k, v: split heads.
        mask: bool (True = may attend) or floating (added to the scores); int masks are refused.
        scale: score scale (default ``1 / sqrt(d_h)``).
        dropout_p: dropout on the probabilities.
        causal: bottom-right causal masking.
        backend: ``"sdpa"`` (fused) or ``"eager"`` (materialises and returns the weights).
        return_weights: default: True exactly for the eager backend.
        softcap: bound the scores with ``softcap * tanh(score / softcap)`` (eager path).
        sinks: an extra logit per query row that takes probability and carries no value (eager path): one
            per head ``(h,)``, or one per row, 4-D broadcastable to ``(b, h, s_q, 1)``.

    Shapes:
        q: (b, h, s_q, d_h); k: (b, h_kv, s_kv, d_h); v: (b, h_kv, s_kv, d_v); sinks: (h,) or
        (b or 1, h, s_q or 1, 1) -> (b, h, s_q, d_v), weights (b, h, s_q, s_kv) or None

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
    h_kv, s_kv = k.shape[1], k.shape[2]
    check_scale(scale)
    check_dropout(dropout_p)
    check_scale(softcap, "softcap")
    check_sinks(sinks, b, h, s_q, q.device)
    if mask is not None:
        mask = validate_mask(mask, (b, h, s_q, s_kv), q.dtype, q.device)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (sinks is not None and sinks.requires_grad))
    plan = plan_attention(h=h, h_kv=h_kv, d_h=d_h, scale=d_h ** -0.5 if scale is None else float(scale),
                          b=b, s_q=s_q, s_kv=s_kv, dtype=q.dtype, device=q.device, backend=backend,
                          causal=causal, has_mask=mask is not None, return_weights=return_weights,
                          dropout_p=float(dropout_p), chunk_queries=False, records_grad=grad, softcap=softcap,
                          sinks=sinks is not None, dead_rows=False if mask is None else partial(has_dead_rows, mask),
                          mask_per_head=mask is not None and mask.shape[1] != 1)
    return attend(plan, q, k, v, mask, sinks)


def available_backends() -> list[str]:
    """Names accepted by ``backend=``.

    Example:
        >>> available_backends()
        ['eager', 'sdpa']
    """
    return list(_BACKENDS)
