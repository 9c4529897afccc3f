"""Which attention kernel runs for given inputs, and why; a warning before O(s^2) memory is spent.

The rules mirror :func:`headwise.functional.attention` exactly:

1. Empty input (b, s_q or s_kv is 0): no kernel runs, the context is zeros.
2. ``return_weights=True`` or ``backend="eager"``: the eager reference, which materialises every head's
   probabilities, ``b * h * s_q * s_kv`` floats (float32 for half-precision inputs, which it upcasts).
3. Otherwise ``F.scaled_dot_product_attention``. Its kernel is PyTorch's choice; we ask PyTorch's own
   selector (``torch._fused_sdp_choice``) on stand-in tensors of the right shapes, dtype and device (no
   data is allocated beyond one element). If that private function is missing or fails, the stated rule
   is: on CPU the flash kernel unless dropout is active (then math); on other devices a fused kernel.
   Only the math kernel materialises the probabilities.

Causal masking on the sdpa path: the kernel's own ``is_causal`` when ``s_q == s_kv`` and no mask is
given (both alignments agree there); no mask at all for a single query (bottom-right: it reads every key);
otherwise an explicit bottom-right ``(s_q, s_kv)`` bool mask combined with the user's mask.

Forward never warns on the fused default path. It warns (:class:`MaterializationWarning`) only when the
eager path is taken and would materialise more than :data:`FORWARD_WARN_BYTES`; :func:`explain` warns
above :data:`WARN_BYTES` (or its ``warn_bytes=``) for any path that materialises.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width (d_model), d_h: head width (d_head).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ._checks import check_input
from .chunking import lse_merge_available
from .masks import validate_mask

if TYPE_CHECKING:
    from .attention import MultiHeadAttention
    from .kv_cache import KVCache

__all__ = ["DispatchInfo", "MaterializationWarning", "explain", "WARN_BYTES", "FORWARD_WARN_BYTES"]

#: explain() warns when a path would materialise more probability bytes than this (256 MiB).
WARN_BYTES = 256 * 2**20
#: forward() on the eager path (backend="eager" or return_weights=True) warns above this (1 GiB).
FORWARD_WARN_BYTES = 2**30

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_KERNELS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


class MaterializationWarning(UserWarning):
    """A path would materialise ``b * h * s_q * s_kv`` attention probabilities above a size threshold."""


@dataclass(frozen=True)
class DispatchInfo:
    """What :meth:`MultiHeadAttention.forward` would run for some inputs, and why.

    Attributes:
        backend: ``"sdpa"``, ``"eager"`` or ``"empty"`` (no kernel: the context is zeros).
        kernel: ``"flash"``, ``"efficient"``, ``"cudnn"``, ``"math"`` (SDPA kernels), ``"eager"`` or ``"none"``.
        materializes_probabilities: whether a ``(b, h, s_q, s_kv)`` probability tensor is built.
        probability_bytes: its size in bytes (0 when nothing is materialised).
        causal_via: ``"kernel is_causal"``, ``"explicit mask"`` or ``"none needed"``.
        scores_shape: ``(b, h, s_q, s_kv)`` as the kernel sees it (s_kv includes cached positions).
        reasons: one sentence per decision taken.
        query_chunk: positions per query chunk when the forward runs in chunks (:mod:`headwise.chunking`),
            else None.

    Shapes:
        scores_shape: (b, h, s_q, s_kv)
    """

    backend: str
    kernel: str
    materializes_probabilities: bool
    probability_bytes: int
    causal_via: str
    scores_shape: tuple[int, int, int, int]
    reasons: tuple[str, ...]
    query_chunk: int | None = None


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _stand_in(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, grad: bool) -> torch.Tensor:
    # One element expanded to the full shape: the selector reads only metadata, so nothing large is allocated.
    base = torch.zeros((1,) * (len(shape) - 1) + (shape[-1],), dtype=dtype, device=device, requires_grad=grad)
    return base.expand(shape)


def _sdpa_kernel(q_shape: tuple[int, int, int, int], kv_shape: tuple[int, int, int, int], dtype: torch.dtype,
                 device: torch.device, mask: torch.Tensor | None, dropout_p: float, is_causal: bool,
                 scale: float, grad: bool) -> tuple[str, str]:
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is not None:
        try:
            q = _stand_in(q_shape, dtype, device, grad)
            k = _stand_in(kv_shape, dtype, device, grad)
            v = _stand_in(kv_shape, dtype, device, grad)
            idx = int(choose(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                             enable_gqa=q_shape[1] != kv_shape[1]))
            if idx in _KERNELS:
                return _KERNELS[idx], f"PyTorch's SDPA selector picks the {_KERNELS[idx]} kernel for these inputs"
        except Exception:  # a private API: any failure falls back to the stated rule
            pass
    if device.type == "cpu":
        if dropout_p > 0:
            return "math", "rule: PyTorch's CPU SDPA uses the math kernel when dropout is active"
        return "flash", "rule: PyTorch's CPU SDPA uses its flash kernel (masks and GQA included) without dropout"
    return "fused", f"rule: on {device.type} PyTorch picks a fused kernel (flash, efficient or cudnn)"


def _query_chunk(attn: "MultiHeadAttention", x: torch.Tensor, context: torch.Tensor | None,
                 cache: "KVCache | None", return_weights: bool) -> int | None:
    if context is not None and context.dim() == 2:
        context = context.unsqueeze(0)
    return attn._query_chunk(x, context, context, cache, return_weights)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def explain(
    attn: "MultiHeadAttention", x: torch.Tensor, *, context: torch.Tensor | None = None,
    mask: torch.Tensor | None = None, causal: bool = False, cache: "KVCache | None" = None,
    return_weights: bool = False, warn_bytes: int | None = None,
) -> DispatchInfo:
    """Implementation of :meth:`MultiHeadAttention.explain_dispatch` (see the module docstring for the rules).

    Shapes:
        x: (b, s_q, d) or (s_q, d); context: (b, s_kv, kdim); mask: broadcastable to (b, h, s_q, s_kv)
    """
    from .kv_cache import KVCache

    cfg = attn.config
    w = attn.q_proj.weight
    x = check_input("x", x, cfg.d_model, "d_model", w.dtype, w.device)
    batched = x.dim() == 3
    b, s_q = (x.shape[0], x.shape[1]) if batched else (1, x.shape[0])
    _check_bool("causal", causal)
    _check_bool("return_weights", return_weights)
    reasons: list[str] = []
    s_kv = s_q
    if context is not None:
        if cache is not None:
            raise ValueError("cache= is for self-attention decoding; cross-attention keys need no cache")
        context = check_input("context", context, cfg.kdim, "kdim", w.dtype, w.device, batched=batched)
        s_kv = context.shape[-2]
    if cache is not None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache (see new_cache), got {type(cache).__name__}")
        s_kv = cache.length + s_q
        if not causal:
            reasons.append(f"a cache forces causal=True (bottom-right): the {s_q} new queries read the "
                           f"{cache.length} cached positions and themselves")
        causal = True
    h = cfg.n_heads
    shape = (b, h, s_q, s_kv)
    if mask is not None:
        mask = validate_mask(mask, shape, w.dtype, w.device)
    dropout_p = cfg.dropout if attn.training else 0.0
    backend = "eager" if return_weights else attn.backend
    rows = getattr(attn, "packed_gemm_rows", None)
    if rows is not None:
        reasons.append(f"use_packed_gemm(rows={rows}): the projections of these b*s_q = {b * s_q} rows run "
                       + ("MKL's packed GEMM when no gradient is needed (outside torch.compile)" if b * s_q == rows
                          else "the ordinary GEMM (a packed copy serves exactly its row count)"))

    if b == 0 or s_q == 0 or s_kv == 0:
        reasons.append(f"empty input (b={b}, s_q={s_q}, s_kv={s_kv}): no kernel runs, the context is zeros")
        return DispatchInfo("empty", "none", False, 0, "none needed", shape, tuple(reasons))

    n_probs = b * h * s_q * s_kv
    if backend == "eager":
        why = ("return_weights=True: only the eager path returns per-head probabilities" if return_weights
               else "backend='eager' was chosen when the layer was built")
        reasons.append(why)
        compute = torch.float32 if w.dtype in _LOW_PRECISION else w.dtype
        nbytes = n_probs * _itemsize(compute)
        reasons.append(f"the eager path materialises b*h*s_q*s_kv = {b}*{h}*{s_q}*{s_kv} probabilities in "
                       f"{compute} ({nbytes} bytes)")
        causal_via = "explicit mask" if causal else "none needed"
        if causal:
            reasons.append("causal: an explicit bottom-right (s_q, s_kv) mask")
        info = DispatchInfo("eager", "eager", True, nbytes, causal_via, shape, tuple(reasons))
    else:
        is_causal = False
        kernel_mask = mask
        if not causal:
            causal_via = "none needed"
        elif s_q == 1:
            causal_via = "none needed"
            reasons.append("causal with a single query: bottom-right alignment lets it read every key, no mask")
        elif mask is None and s_q == s_kv:
            causal_via, is_causal = "kernel is_causal", True
            reasons.append("causal with s_q == s_kv and no mask: the kernel's own is_causal (both alignments agree)")
        else:
            causal_via = "explicit mask"
            why = "a mask is given" if mask is not None else f"s_q={s_q} != s_kv={s_kv}"
            reasons.append(f"causal and {why}: an explicit bottom-right (s_q, s_kv) mask, because SDPA's "
                           f"is_causal is top-left aligned")
            mask_dtype = mask.dtype if mask is not None else torch.bool
            mask_shape = torch.broadcast_shapes(tuple(mask.shape) if mask is not None else (), (s_q, s_kv))
            kernel_mask = torch.zeros((), dtype=mask_dtype, device=w.device).expand(mask_shape)
        grad = torch.is_grad_enabled() and w.requires_grad
        kernel, why = _sdpa_kernel((b, h, s_q, cfg.d_head), (b, cfg.n_kv_heads, s_kv, cfg.d_head), w.dtype, w.device, kernel_mask,
                                   dropout_p, is_causal, cfg.scale, grad)
        reasons.append(why)
        materializes = kernel == "math"
        nbytes = n_probs * _itemsize(w.dtype) if materializes else 0
        if materializes:
            reasons.append(f"the math kernel materialises b*h*s_q*s_kv = {b}*{h}*{s_q}*{s_kv} probabilities "
                           f"({nbytes} bytes)")
        else:
            reasons.append("the fused kernel never materialises the probabilities")
        chunk = _query_chunk(attn, x if batched else x.unsqueeze(0), context, cache, return_weights)
        if chunk is not None:
            reasons.append(f"no autograd and the unchunked Q, K, V and context exceed "
                           f"headwise.chunking.CHUNK_ABOVE_BYTES: queries run {chunk} positions at a time, "
                           f"each chunk reading only the keys its queries may read")
            if causal:
                lse = mask is None and s_kv >= s_q and lse_merge_available(w.device, w.dtype)
                causal_via = "kernel is_causal" if lse else "explicit mask"
                reasons.append("causal chunks: a fully read key prefix and the kernel's is_causal on the square "
                               "diagonal block, merged by log-sum-exp" if lse else
                               "causal chunks: an explicit bottom-right mask per chunk")
        info = DispatchInfo("sdpa", kernel, materializes, nbytes, causal_via, shape, tuple(reasons), chunk)

    threshold = WARN_BYTES if warn_bytes is None else warn_bytes
    if info.materializes_probabilities and info.probability_bytes > threshold:
        warnings.warn(MaterializationWarning(
            f"the {info.backend} path ({info.kernel} kernel) would materialise {info.probability_bytes} bytes of "
            f"attention probabilities (b*h*s_q*s_kv = {b}*{h}*{s_q}*{s_kv}), above {threshold}; use "
            f"backend='sdpa' without return_weights (and without dropout) to avoid it"), stacklevel=3)
    return info


def warn_if_eager_too_large(q: torch.Tensor, k: torch.Tensor) -> None:
    """Called by the layer on its eager path only: warn above :data:`FORWARD_WARN_BYTES` (shape arithmetic only).

    Shapes:
        q: (b, h, s_q, d_h); k: (b, h_kv, s_kv, d_h)
    """
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4 and k.dim() == 4):
        return  # malformed input: functional.attention raises the proper error next
    b, h, s_q, _ = q.shape
    s_kv = k.shape[-2]
    itemsize = 4 if q.dtype in _LOW_PRECISION else q.element_size()
    nbytes = b * h * s_q * s_kv * itemsize
    if nbytes > FORWARD_WARN_BYTES:
        warnings.warn(MaterializationWarning(
            f"the eager path materialises b*h*s_q*s_kv = {b}*{h}*{s_q}*{s_kv} attention probabilities "
            f"({nbytes} bytes, above headwise.dispatch.FORWARD_WARN_BYTES={FORWARD_WARN_BYTES}); use "
            f"backend='sdpa' without return_weights to avoid it"), stacklevel=4)
