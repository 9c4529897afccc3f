"""The functional core: splitting and merging heads, and the attention math itself.

Everything here is a pure function of tensors (no modules, no parameters), so it can be read against the
formula line by line. The modules in :mod:`headwise.attention` and :mod:`headwise.head` only hold weights
and call these.

Shapes (one glossary for the whole package):
    b: batch, s / s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width (d_model), d_h: head width (d_head), g = h // h_kv: query heads per K/V head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import check_causal
from .masks import causal_mask, combine_masks, validate_mask

__all__ = [
    "split_heads",
    "merge_heads",
    "eager_attention",
    "sdpa_attention",
    "attention",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


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
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"split_heads expects a packed projection (b, s, h * d_h), got {got}")
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads <= 0:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
    b, s, width = x.shape
    if width % n_heads:
        raise ValueError(f"cannot split width {width} into n_heads={n_heads} equal heads")
    return x.view(b, s, n_heads, width // n_heads).transpose(1, 2)  # (b, h, s, d_h)


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
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"merge_heads expects split heads (b, h, s, d_h), got {got}")
    b, h, s, d_h = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d_h)  # (b, s, h * d_h)


def _causal_as_mask(mask: torch.Tensor | None, s_q: int, s_kv: int, device: torch.device) -> torch.Tensor | None:
    return combine_masks(mask, causal_mask(s_q, s_kv, device=device))


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
    scale: float | None = None, dropout_p: float = 0.0, causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention that materialises every head's softmax: ``softmax(Q K^T * scale + mask) V``.

    Under GQA query head ``i`` reads K/V head ``i // g``; the g query heads of a group are folded into
    one matrix so K and V are never repeated in memory. Half-precision inputs are computed in float32
    (scores of large inputs overflow float16). A row that may read nothing gets zero weights and a zero
    context. ``causal`` is bottom-right aligned (see :mod:`headwise.masks`).

    Shapes:
        q: (b, h, s_q, d_h); k, v: (b, h_kv, s_kv, d_h); mask: broadcastable to (b, h, s_q, s_kv)
        -> context (b, h, s_q, d_h), weights (b, h, s_q, s_kv)

    Example:
        >>> q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
        >>> out, w = eager_attention(q, k, v)
        >>> out.shape, w.shape, bool(torch.allclose(w.sum(-1), torch.ones(1, 4, 3)))
        (torch.Size([1, 4, 3, 8]), torch.Size([1, 4, 3, 5]), True)
    """
    b, h, s_q, d_h = q.shape
    h_kv, s_kv = k.shape[1], k.shape[2]
    g = h // h_kv
    scale = d_h ** -0.5 if scale is None else scale
    out_dtype = q.dtype
    if q.dtype in _LOW_PRECISION:
        q, k, v = q.float(), k.float(), v.float()
    if causal:
        mask = _causal_as_mask(mask, s_q, s_kv, q.device)
    # Scale the queries, not the scores: q has s_kv / d_h times fewer entries (8x at s 512, d_h 64). Without
    # autograd one pass both scales q and lays it out contiguously, the copy the batched matmul makes anyway.
    if torch.is_grad_enabled() and q.requires_grad:
        q = q * scale
    else:
        q = torch.mul(q, scale, out=torch.empty(q.shape, dtype=q.dtype, device=q.device))
    q_grouped = q.reshape(b, h_kv, g * s_q, d_h)  # (b, h_kv, g * s_q, d_h): a group's queries stacked
    if b > 1 and h_kv > 1 and k.stride(0) != h_kv * k.stride(1):
        # The head split leaves K as a strided view whose (b, h_kv) axes cannot merge into one batch axis,
        # so the batched matmul below would copy K^T element by element (2 ms of a 10 ms step at b4 s128
        # h32 d_h 128). A row-wise copy of K is 25x cheaper and K^T is then read through BLAS's transpose
        # flag. A KV-cache slice (mergeable axes) is left alone: copying it would cost O(context) per token.
        k = k.contiguous()
    scores = (q_grouped @ k.transpose(-2, -1)).view(b, h, s_q, s_kv)  # (b, h, s_q, s_kv)
    blocked = None
    if mask is not None:
        # scores is this function's own buffer: mask it in place (neither op needs it for autograd).
        if mask.dtype == torch.bool:
            scores = scores.masked_fill_(~mask, float("-inf"))
        else:
            scores = scores.add_(mask)
        # A fully blocked row is all -inf; softmax would give 0/0. Zero is the only answer that
        # adds nothing to the residual stream, and it keeps NaN from genuinely bad inputs visible.
        blocked = (scores == float("-inf")).all(-1, keepdim=True)
    if torch.is_grad_enabled() and scores.requires_grad:
        weights = torch.softmax(scores, dim=-1)
        weights = weights.masked_fill(blocked, 0.0) if blocked is not None else weights
    else:
        # Without autograd the scores are dead after the softmax: reuse their buffer, so one
        # (b, h, s_q, s_kv) tensor is allocated, not two (a fresh s x s buffer costs about a softmax).
        weights = torch.softmax(scores, dim=-1, out=scores)
        weights = weights.masked_fill_(blocked, 0.0) if blocked is not None else weights
    probs = F.dropout(weights, p=dropout_p, training=True) if dropout_p > 0 else weights
    out = probs.view(b, h_kv, g * s_q, s_kv) @ v  # (b, h_kv, g * s_q, d_h)
    return out.view(b, h, s_q, d_h).to(out_dtype), weights.to(out_dtype)  # (b, h, s_q, d_h)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
    scale: float | None = None, dropout_p: float = 0.0, causal: bool = False,
) -> tuple[torch.Tensor, None]:
    """Fused attention through ``F.scaled_dot_product_attention``: never materialises probabilities
    when no mask is given, uses native GQA (no repeated K/V), and the kernel's own causal path.

    SDPA's ``is_causal`` is top-left aligned, so it is used only when ``s_q == s_kv`` (where both
    alignments agree); a single query reads every key and needs no mask; any other causal case gets an
    explicit bottom-right mask.

    Shapes:
        q: (b, h, s_q, d_h); k, v: (b, h_kv, s_kv, d_h) -> context (b, h, s_q, d_h), None

    Example:
        >>> q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
        >>> a, _ = sdpa_attention(q, k, v, causal=True)
        >>> b, _ = eager_attention(q, k, v, causal=True)
        >>> torch.testing.assert_close(a, b)
    """
    s_q, s_kv = q.shape[-2], k.shape[-2]
    is_causal = False
    if causal and s_q > 1:  # bottom-right: a single query reads every key, so needs no mask
        if mask is None and s_q == s_kv:
            is_causal = True
        else:
            mask = _causal_as_mask(mask, s_q, s_kv, q.device)
    b, h, _, d_h = q.shape
    h_kv = k.shape[1]
    if s_q == 1 and h != h_kv and mask is None:
        # Decoding under GQA/MQA: fold each group's g query heads into g query rows of its K/V head, so the
        # kernel reads every K/V head once for g queries instead of g times (1.6-2.6x faster at h 32,
        # h_kv 8, 4096 cached positions on CPU; HF does the same). Query head i still reads K/V head i // g.
        out = F.scaled_dot_product_attention(q.reshape(b, h_kv, h // h_kv, d_h), k, v, dropout_p=dropout_p,
                                             scale=scale)  # (b, h_kv, g, d_v)
        return out.reshape(b, h, 1, v.shape[-1]), None  # (b, h, 1, d_v)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=h != h_kv,
    )
    return out, None


_BACKENDS = {"sdpa": sdpa_attention, "eager": eager_attention}


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
    scale: float | None = None, dropout_p: float = 0.0, causal: bool = False, backend: str = "sdpa",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run one backend, with the edge cases every backend must agree on handled once here.

    Empty queries or keys give an empty or zero context (and zero weights) instead of a kernel error.

    Shapes:
        q: (b, h, s_q, d_h); k, v: (b, h_kv, s_kv, d_h) -> (b, h, s_q, d_h), weights (b, h, s_q, s_kv) or None

    Example:
        >>> q = torch.randn(2, 4, 0, 8); k = v = torch.randn(2, 4, 5, 8)
        >>> attention(q, k, v)[0].shape
        torch.Size([2, 4, 0, 8])
    """
    try:
        fn = _BACKENDS[backend]
    except KeyError:
        raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}") from None
    _check_qkv(q, k, v)
    check_causal(causal)
    b, h, s_q, d_h = q.shape
    s_kv = k.shape[-2]
    if mask is not None:
        mask = validate_mask(mask, (b, h, s_q, s_kv), q.dtype, q.device)
    if s_q == 0 or s_kv == 0 or b == 0:
        out = q.new_zeros(b, h, s_q, v.shape[-1])
        weights = q.new_zeros(b, h, s_q, s_kv) if backend == "eager" else None
        return out, weights
    return fn(q, k, v, mask=mask, scale=scale, dropout_p=dropout_p, causal=causal)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shape/dtype/device agreement of split heads (metadata only: nothing reads tensor data)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            want = "(b, h, s_q, d_h)" if name == "q" else "(b, h_kv, s_kv, d_h)"
            raise ValueError(f"{name} must be a 4-D tensor {want}, got {got}")
    qs, ks, vs = q.shape, k.shape, v.shape
    if qs[0] == ks[0] and ks[:3] == vs[:3] and qs[3] == ks[3] and ks[1] and not qs[1] % ks[1]:
        if q.dtype == k.dtype == v.dtype and q.device == k.device == v.device:
            return  # the common case: no message is built
    got = f"q {tuple(qs)}, k {tuple(ks)}, v {tuple(vs)}"
    if not qs[0] == ks[0] == vs[0]:
        raise ValueError(f"q, k, v must share the batch size b; got {got}")
    if ks[:3] != vs[:3]:
        raise ValueError(f"k and v must share (b, h_kv, s_kv); got {got}")
    if qs[3] != ks[3]:
        raise ValueError(f"q and k must share d_h; got {got}")
    if ks[1] == 0 or qs[1] % ks[1]:
        raise ValueError(f"query heads h={qs[1]} must be a multiple of K/V heads h_kv={ks[1]}; got {got}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")


def available_backends() -> list[str]:
    """Names accepted by ``backend=``.

    Example:
        >>> available_backends()
        ['eager', 'sdpa']
    """
    return sorted(_BACKENDS)
