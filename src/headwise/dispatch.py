"""What a forward would run, in words: :meth:`MultiHeadAttention.explain_dispatch` formats a
:class:`~headwise.plan.Plan` (the same one ``forward`` executes; the rules are in :mod:`headwise.plan`).

The one thing a plan leaves to PyTorch is which SDPA kernel runs; :func:`describe` asks PyTorch's own
selector (``torch._fused_sdp_choice``) on stand-in tensors of the right shapes, dtype and device (one element
each, expanded). If that private function is missing or fails, the stated rule is: on CPU the flash kernel
unless dropout is active (then math); on other devices a fused kernel. Only the math kernel materialises
the probabilities. ``describe`` warns (:class:`MaterializationWarning`) above :data:`WARN_BYTES` (or its
``warn_bytes``) for any path that materialises; ``forward`` warns only on the eager path, above
:data:`headwise.plan.FORWARD_WARN_BYTES`.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width (d_model), d_h: head width (d_head).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from torch.nn.attention import SDPBackend, sdpa_kernel

from .plan import CacheRead, Causal, Grouping, MaterializationWarning, Plan, Statistics, statistics_rows

__all__ = ["DispatchInfo", "MaterializationWarning", "describe", "WARN_BYTES"]

#: describe() (explain_dispatch) warns when a path would materialise more probability bytes than this (256 MiB).
WARN_BYTES = 256 * 2**20

_KERNELS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
_ALL_KERNELS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                SDPBackend.MATH)


@dataclass(frozen=True)
class DispatchInfo:
    """What :meth:`MultiHeadAttention.forward` would run for some inputs, and why.

    Attributes:
        backend: ``"sdpa"``, ``"eager"`` or ``"empty"`` (no kernel: the context is zeros).
        kernel: ``"flash"``, ``"efficient"``, ``"cudnn"``, ``"math"`` (SDPA kernels), ``"eager"``, ``"none"``, or
            for per-head statistics (``backend="statistics"``) ``"triton"`` (the fused kernel) or ``"chunks"``.
        materializes_probabilities: whether a ``(b, h, s_q, s_kv)`` probability tensor is built.
        probability_bytes: its size in bytes (0 when nothing is materialised).
        causal_via: ``"kernel is_causal"``, ``"explicit mask"`` or ``"none needed"`` (the plan's
            :class:`~headwise.plan.Causal`, in words).
        scores_shape: ``(b, h, s_q, s_kv)`` as the kernel sees it (s_kv includes cached positions).
        reasons: one sentence per decision taken.
        query_chunk: positions per query chunk when the forward runs in chunks (:mod:`headwise.chunking`),
            else None.
        plan: the :class:`~headwise.plan.Plan` itself.

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
    plan: Plan | None = None


def _math_itemsize(dtype: torch.dtype) -> int:
    """Bytes per probability of SDPA's math kernel: it upcasts half precision to float32 unless PyTorch's
    fp16/bf16 reduction flag is on."""
    allowed = getattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed", None)
    if dtype in (torch.float16, torch.bfloat16) and not (allowed is not None and allowed()):
        return 4
    return dtype.itemsize


def _sdpa_kernel(plan: Plan, d_head: int, n_kv_heads: int, dtype: torch.dtype, device: torch.device,
                 mask_shape: tuple[int, ...] | None, mask_dtype: torch.dtype | None, grad: bool) -> tuple[str, str]:
    b, h, s_q, s_kv = plan.shape
    if plan.causal_via is Causal.MASK or plan.cache_read in (CacheRead.BUFFER, CacheRead.POSITION):
        mask_shape = torch.broadcast_shapes(mask_shape or (), (s_q, s_kv))
        mask_dtype = mask_dtype or torch.bool
    # The kernel sees the tensors after the plan's grouping: folded rows, or K/V repeated to every query head.
    q_shape, kv_heads = (b, h, s_q, d_head), n_kv_heads
    if plan.grouping is Grouping.FOLD:
        q_shape = (b, n_kv_heads, h // n_kv_heads, d_head)
    elif plan.grouping is Grouping.REPEAT:
        kv_heads = h
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is not None:
        try:
            def stand_in(shape: tuple[int, ...], dt: torch.dtype, requires_grad: bool = False) -> torch.Tensor:
                base = torch.zeros((1,) * (len(shape) - 1) + (shape[-1],), dtype=dt, device=device,
                                   requires_grad=requires_grad)
                return base.expand(shape)  # the selector reads metadata only: nothing large is allocated

            q = stand_in(q_shape, dtype, grad)
            k = stand_in((b, kv_heads, s_kv, d_head), dtype, grad)
            mask = None if mask_shape is None else stand_in(tuple(mask_shape), mask_dtype)
            def pick() -> int:
                return int(choose(q, k, k, attn_mask=mask, dropout_p=plan.dropout_p, is_causal=plan.is_causal,
                                  scale=plan.scale, enable_gqa=plan.enable_gqa))

            if plan.avoid_cudnn:
                with sdpa_kernel([b for b in _ALL_KERNELS if b != SDPBackend.CUDNN_ATTENTION]):
                    idx = pick()
            else:
                idx = pick()
            if idx in _KERNELS:
                return _KERNELS[idx], f"PyTorch's SDPA selector picks the {_KERNELS[idx]} kernel for these inputs"
        except Exception:  # a private API: any failure falls back to the stated rule
            pass
    if device.type == "cpu":
        if plan.dropout_p > 0:
            return "math", "rule: PyTorch's CPU SDPA uses the math kernel when dropout is active"
        return "flash", "rule: PyTorch's CPU SDPA uses its flash kernel (masks and GQA included) without dropout"
    return "fused", f"rule: on {device.type} PyTorch picks a fused kernel (flash, efficient or cudnn)"


def _statistics_reasons(plan: Plan, dtype: torch.dtype) -> list[str]:
    """How the plan computes its per-head statistics (plan rule 10), and what that costs."""
    b, h, s_q, s_kv = plan.shape
    names = ", ".join(plan.statistics)
    out = [f"per-head statistics asked for ({names}): {plan.statistics_via.value}"]
    if plan.statistics_via is Statistics.KERNEL:
        out.append("the context, lse, entropy (a running sum of p * score) and max_weight come from one flash-"
                   "attention pass, the cost of a plain forward plus a few operations per score"
                   + ("; key_weight from a second pass over key blocks that recomputes the scores with the lse "
                      "(about half a forward more)" if "key_weight" in plan.statistics else ""))
        return out
    # The chunks accumulate in float32, float64 for a float64 layer (headwise.statistics.chunks).
    rows = statistics_rows(b, h, s_q, s_kv, 8 if dtype == torch.float64 else 4)
    chunk = f"{rows} query rows at a time ({b}*{h}*{rows}*{s_kv} scores, never the {b}*{h}*{s_q}*{s_kv} pattern)"
    if plan.statistics_via is Statistics.BESIDE:
        why = ("the call returns its probabilities" if plan.return_weights else
               "dropout is active" if plan.dropout_p else "autograd records the call")
        out.append(f"{why}: its own path computes the context, and a second pass over the scores, {chunk}, the "
                   f"statistics (about one more attention's work; they carry no gradient)")
    else:
        out.append(f"one pass over the scores, {chunk}, each chunk reading only the keys its rows may read; "
                   f"its probabilities give the context (one (rows, keys) x (keys, d_h) product) and the "
                   f"statistics (a maximum and a dot product per row, one (1, rows) x (rows, keys) product for "
                   f"key_weight)")
    return out


def _reasons(plan: Plan, causal_given: bool, cache_length: int, dtype: torch.dtype) -> list[str]:
    b, h, s_q, s_kv = plan.shape
    out = []
    if plan.cached and not causal_given:
        out.append(f"a cache forces causal=True (bottom-right): the {s_q} new queries read the "
                   f"{cache_length} cached positions and themselves")
    if plan.backend == "empty":
        return out + [f"empty input (b={b}, s_q={s_q}, s_kv={s_kv}): no kernel runs, the context is zeros"]
    if plan.statistics:
        out += _statistics_reasons(plan, dtype)
    if plan.backend == "eager":
        if plan.return_weights:
            out.append("return_weights=True: only the eager path returns per-head probabilities")
        elif plan.softcap is not None or plan.sinks:
            out.append("a score softcap and attention sinks run on the eager path" if plan.softcap is not None
                       and plan.sinks else "a score softcap runs on the eager path" if plan.softcap is not None
                       else "attention sinks run on the eager path")
        elif plan.min_rows_eager:
            out.append("autograd records a floating mask with a row whose readable keys are all at the dtype's "
                       "minimum (Hugging Face's padding): PyTorch's fused backward is wrong on such rows, the "
                       "eager path's is the formula's")
        else:
            out.append("backend='eager' was chosen when the layer was built")
        out.append(f"the eager path materialises b*h*s_q*s_kv = {b}*{h}*{s_q}*{s_kv} probabilities "
                   f"({plan.probability_bytes} bytes)")
    if plan.cache_read is CacheRead.POSITION:
        out.append(f"under torch.compile a cached call reads the cache's whole buffer ({s_kv} positions) under a "
                   f"mask built on the device from the cache's position: the same shapes at every position, so "
                   f"one graph serves them all")
    elif plan.cache_read is CacheRead.BUFFER:
        out.append(f"a cached call on {plan.device_type} in half precision reads the cache's whole buffer ({s_kv} "
                   f"positions) under a mask of the filled ones: the same shape at every position, so cuDNN "
                   f"builds one execution plan per cache, not one per position")
    elif plan.causal and s_q == 1:
        out.append("causal with a single query: bottom-right alignment lets it read every key, no mask")
    elif plan.chunk is not None:
        out.append(f"no autograd on CPU and the unchunked Q, K, V and context exceed headwise.plan.CHUNK_ABOVE_BYTES"
                   if not plan.chunk_forced else "the layer's chunk_queries fixes the chunk length")
        out.append(f"queries run {plan.chunk} positions at a time, each chunk reading only the keys its queries "
                   f"may read")
        if plan.causal:
            out.append("causal chunks: a fully read key prefix and the kernel's is_causal on the square diagonal "
                       "block, merged by log-sum-exp" if plan.lse_chunks else
                       "causal chunks: an explicit bottom-right mask per chunk")
    elif plan.backend == "statistics" and plan.causal:
        out.append("causal (bottom-right): a query block reads keys only up to its last query and masks the "
                   "diagonal itself")
    elif plan.causal_via is Causal.KERNEL:
        out.append("causal with s_q == s_kv and no mask: the kernel's own is_causal (both alignments agree)")
    elif plan.causal_via is Causal.MASK:
        why = "a mask is given" if plan.has_mask else (f"s_q={s_q} != s_kv={s_kv}" if s_q != s_kv
                                                        else "the eager path")
        out.append(f"causal and {why}: an explicit bottom-right (s_q, s_kv) mask"
                   + (", because SDPA's is_causal is top-left aligned" if plan.backend == "sdpa" else ""))
    if plan.hooked:
        out.append("q_proj or out_proj has forward hooks: one pass, not query chunks, so each hook sees every "
                   "row in one call")
    if plan.backend == "sdpa" and plan.device_type != "cpu" and plan.chunk is None and plan.cached is False \
            and s_q > 1:
        out.append(f"no query chunks on {plan.device_type}: its fused kernels already hold O(s) memory")
    if plan.grouping is Grouping.FOLD:
        out.append("one query under GQA/MQA: each group's query heads become query rows of its K/V head, so "
                   "every K/V head is read once per group")
    elif plan.grouping is Grouping.REPEAT:
        out.append(f"GQA on {plan.device_type} where the best fused kernel for these inputs (memory-efficient: "
                   f"float32 or a mask) cannot group heads: K and V are repeated to every query head "
                   f"(b*h*s_kv*d_h more memory) instead of falling to the math kernel (b*h*s_q*s_kv)")
    elif plan.grouping is Grouping.KERNEL and plan.backend == "sdpa":
        out.append("GQA: SDPA's enable_gqa, K/V heads read in place")
    if plan.avoid_cudnn:
        out.append(f"keys from a growing cache on {plan.device_type} (a decode step): SDPA may not use cuDNN for "
                   f"this call, which builds an execution plan for every new shape (tens of milliseconds each)")
    if plan.zero_dead_rows:
        out.append("a row that may read no key is zeroed by headwise after the kernel, on every kernel and "
                   "dtype (tensor operations, no host synchronisation)")
    return out


def describe(plan: Plan, *, d_head: int, n_kv_heads: int, dtype: torch.dtype, device: torch.device,
             mask: torch.Tensor | None = None, grad: bool = False, causal_given: bool = False,
             cache_length: int = 0, warn_bytes: int | None = None) -> DispatchInfo:
    """Format ``plan`` as a :class:`DispatchInfo`, asking PyTorch which SDPA kernel it would pick.

    Shapes:
        plan.shape: (b, h, s_q, s_kv); mask: broadcastable to it
    """
    b, h, s_q, s_kv = plan.shape
    reasons = _reasons(plan, causal_given, cache_length, dtype)
    if plan.backend == "empty":
        kernel, nbytes = "none", 0
    elif plan.backend == "eager":
        kernel, nbytes = "eager", plan.probability_bytes
    elif plan.backend == "statistics":
        kernel, nbytes = "triton" if plan.statistics_via is Statistics.KERNEL else "chunks", 0
    else:
        kernel, why = _sdpa_kernel(plan, d_head, n_kv_heads, dtype, device,
                                   None if mask is None else tuple(mask.shape),
                                   None if mask is None else mask.dtype, grad)
        reasons.append(why)
        nbytes = b * h * s_q * s_kv * _math_itemsize(dtype) if kernel == "math" else 0
        reasons.append(f"the math kernel materialises b*h*s_q*s_kv = {b}*{h}*{s_q}*{s_kv} probabilities "
                       f"({nbytes} bytes)" if nbytes else "the fused kernel never materialises the probabilities")
    info = DispatchInfo(plan.backend, kernel, nbytes > 0, nbytes, plan.causal_via.value, plan.shape, tuple(reasons),
                        plan.chunk, plan)
    threshold = WARN_BYTES if warn_bytes is None else warn_bytes
    if nbytes > threshold:
        warnings.warn(MaterializationWarning(
            f"the {info.backend} path ({kernel} kernel) would materialise {nbytes} bytes of attention "
            f"probabilities (b*h*s_q*s_kv = {b}*{h}*{s_q}*{s_kv}), above {threshold}; use backend='sdpa' "
            f"without return_weights (and without dropout) to avoid it"), stacklevel=3)
    return info
