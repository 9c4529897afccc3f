"""One decision per call: which attention path runs, how causality is applied, whether queries are chunked.

:func:`plan_attention` is a pure function of sizes, dtypes and flags (it never reads tensor data). The layer's
``forward`` executes the :class:`Plan` it returns; ``explain_dispatch`` formats the same plan; nothing else
decides. The rules:

1. **Empty** (b, s_q or s_kv is 0): no kernel runs; the context is zeros.
2. **Backend**: ``return_weights=True``, ``backend="eager"``, a score softcap or attention sinks take the
   eager path (:func:`headwise.functional.softmax_attention`), which materialises every head's probabilities
   (``b * h * s_q * s_kv`` floats, float32 for half-precision inputs). So does a floating mask with a row
   that is entirely at the dtype's minimum (Hugging Face's padding convention) while autograd records:
   PyTorch's fused CPU backward is wrong on such rows (docs/guarantees.md has the reproduction).
   Everything else runs ``F.scaled_dot_product_attention``.
3. **Causal** (a cache forces it: new tokens read the cache and themselves), always bottom-right aligned:
   a single query reads every key, so needs no mask; with ``s_q == s_kv`` and no mask the fused kernel's own
   ``is_causal`` runs (the two alignments agree there); otherwise an explicit bottom-right mask.
4. **GQA decode**: one query under GQA/MQA without a mask folds each group's query heads into query rows of
   its K/V head, so the CPU kernel reads every K/V head once per group rather than once per query head.
5. **Chunks**: without autograd, on the fused path without dropout, cache or returned weights, a forward
   whose Q, K, V and context together exceed :data:`CHUNK_ABOVE_BYTES` runs its queries
   :data:`CHUNK_BYTES` at a time (:mod:`headwise.chunking`). A layer's ``chunk_queries`` can turn this off
   (False) or fix the chunk length (an int). Causal chunks without a mask, on CPU in float32/float64, run
   as a fully read key prefix plus the square diagonal block with the kernel's ``is_causal``, merged by
   log-sum-exp; elsewhere a chunk gets an explicit bottom-right mask.
6. **Warning**: the eager path warns above :data:`FORWARD_WARN_BYTES` of probabilities, before any work.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length (cached positions included), h: query heads,
    h_kv: key/value heads, d: model width, d_h: head width.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch


__all__ = ["Plan", "plan_attention", "MaterializationWarning", "forward_warning", "CHUNK_ABOVE_BYTES", "CHUNK_BYTES", "FORWARD_WARN_BYTES",
           "lse_merge_available"]

#: Chunk a forward whose unchunked Q, K, V and context together would take more than this (512 MiB).
CHUNK_ABOVE_BYTES = 512 * 2**20
#: Target size of one chunk's queries (16 MiB): 1024 positions at b 1, d 4096 in float32.
CHUNK_BYTES = 16 * 2**20
#: Chunks are a multiple of this many positions (the CPU flash kernel's query block), and never shorter.
CHUNK_ALIGN = 256
#: forward() on the eager path warns when it would materialise more probability bytes than this (1 GiB).
FORWARD_WARN_BYTES = 2**30

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class MaterializationWarning(UserWarning):
    """A path would materialise ``b * h * s_q * s_kv`` attention probabilities above a size threshold."""


class Plan(NamedTuple):
    """What one attention call runs (a NamedTuple so ``torch.compile`` traces it as constants).

    Attributes:
        shape: ``(b, h, s_q, s_kv)`` of the scores, cached positions included.
        backend: ``"sdpa"``, ``"eager"`` or ``"empty"``.
        causal_via: ``"none needed"``, ``"kernel is_causal"`` or ``"explicit mask"``.
        causal: whether the call is causal at all (given, or forced by a cache).
        has_mask: whether a user mask is applied.
        enable_gqa: SDPA's ``enable_gqa``, from the head counts (h != h_kv), never from tensor shapes.
        fold_decode: one query under GQA/MQA: a group's query heads become query rows of its K/V head.
        chunk: query positions per chunk, or None for one pass.
        lse_chunks: causal chunks merge a key prefix and the diagonal block by log-sum-exp.
        probability_bytes: bytes of probabilities the eager path materialises (0 on the fused path; the
            SDPA math kernel's own buffers are PyTorch's choice, reported by ``explain_dispatch``).
        warn: forward warns (:class:`headwise.MaterializationWarning`) before running.
        scale: the score scale; dropout_p: dropout on the probabilities (0 outside training).
        cached: a KV cache supplies earlier positions; return_weights: the call returns probabilities.
        chunk_forced: the layer fixed the chunk length (``chunk_queries`` is an int).
        softcap: the score softcap or None; sinks: the call adds one sink logit per head.
    """

    shape: tuple[int, int, int, int]
    backend: str
    causal_via: str
    causal: bool
    has_mask: bool
    enable_gqa: bool
    fold_decode: bool
    chunk: int | None
    lse_chunks: bool
    probability_bytes: int
    warn: bool
    scale: float
    dropout_p: float
    cached: bool
    return_weights: bool
    chunk_forced: bool
    softcap: float | None = None
    sinks: bool = False

    @property
    def is_causal(self) -> bool:
        """SDPA's ``is_causal`` flag."""
        return self.causal_via == "kernel is_causal"

    def for_chunk(self, s_q: int, s_kv: int) -> "Plan":
        """The plan of one query chunk attending to its ``s_kv`` readable keys (one pass, same rules)."""
        b, h = self.shape[0], self.shape[1]
        via = causal_mode(self.backend, self.causal, self.has_mask, s_q, s_kv)
        return self._replace(shape=(b, h, s_q, s_kv), causal_via=via, chunk=None, lse_chunks=False,
                             fold_decode=self.fold_decode and s_q == 1)


def causal_mode(backend: str, causal: bool, has_mask: bool, s_q: int, s_kv: int) -> str:
    """How causality is applied (rule 3 of the module docstring)."""
    if not causal or s_q == 1:
        return "none needed"
    if backend == "sdpa" and not has_mask and s_q == s_kv:
        return "kernel is_causal"
    return "explicit mask"


def lse_merge_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether causal chunks can run as two flash calls merged by log-sum-exp here (CPU, float32/float64,
    and PyTorch exposes its CPU flash op with the log-sum-exp); elsewhere they use an explicit mask.

    Shapes:
        no tensors: a rule on the device and dtype only.

    Example:
        >>> lse_merge_available(torch.device("cpu"), torch.float32), lse_merge_available(torch.device("cpu"), torch.bfloat16)
        (True, False)
    """
    return (device.type == "cpu" and dtype in (torch.float32, torch.float64)
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def chunk_length(h: int, h_kv: int, d_h: int, b: int, s_q: int, s_kv: int, dtype: torch.dtype,
                 setting: bool | int = True) -> int | None:
    """Query positions per chunk for a forward of these sizes (rule 5), or None for one pass.

    ``setting`` is the layer's ``chunk_queries``: True (the size rule), False (never) or an int (that many
    positions per chunk whenever chunking is allowed).

    Shapes:
        x: (b, s_q, h * d_h); keys/values: (b, s_kv, h_kv * d_h)

    Example:
        >>> chunk_length(32, 32, 128, 1, 8192, 8192, torch.float32) is None       # Q, K, V, context: 512 MiB
        True
        >>> chunk_length(32, 32, 128, 1, 16384, 16384, torch.float32)             # 1 GiB: chunks of 1024
        1024
        >>> chunk_length(32, 32, 128, 1, 10, 10, torch.float32, setting=4)        # a fixed length
        4
    """
    if setting is False:
        return None
    if setting is not True:
        return setting if setting < s_q else None
    itemsize = dtype.itemsize
    q_bytes = b * s_q * h * d_h * itemsize
    if 2 * q_bytes + 2 * b * s_kv * h_kv * d_h * itemsize <= CHUNK_ABOVE_BYTES:  # Q, context; K, V
        return None
    per_position = max(1, b * h * d_h * itemsize)
    c = max(CHUNK_ALIGN, CHUNK_BYTES // per_position // CHUNK_ALIGN * CHUNK_ALIGN)
    return c if c < s_q else None


def plan_attention(
    *, h: int, h_kv: int, d_h: int, scale: float, b: int, s_q: int, s_kv: int, dtype: torch.dtype,
    device: torch.device, backend: str = "sdpa", causal: bool = False, has_mask: bool = False,
    cached: bool = False, return_weights: bool = False, dropout_p: float = 0.0, chunk_queries: bool | int = True,
    records_grad: bool = False, softcap: float | None = None, sinks: bool = False,
    dead_rows: bool | Callable[[], bool] = False,
) -> Plan:
    """The plan of one attention call (see the module docstring for the rules). Inputs are trusted: the
    caller validated them (``MultiHeadAttention.forward`` and ``functional.attention`` do).

    Args:
        h, h_kv, d_h: query heads, key/value heads, head width; scale: the score scale.
        b, s_q, s_kv: batch, query length, key length (cached positions included).
        dtype, device: of the queries.
        backend: the layer's backend, ``"sdpa"`` or ``"eager"``.
        causal: causal attention was asked for (a cache forces it).
        has_mask: a mask is given.
        cached: a KV cache supplies the keys.
        return_weights: per-head probabilities are returned.
        dropout_p: dropout on the probabilities (0 outside training).
        chunk_queries: the layer's chunking setting (see :func:`chunk_length`).
        records_grad: autograd records this call (no chunks then: a backward keeps every chunk).
        softcap, sinks: a score softcap, attention sinks (both run eager).
        dead_rows: the floating mask has a row entirely at the dtype's minimum (rule 2); a callable is asked
            only when its answer can change the backend (reading the mask is a data-dependent step, which
            torch.export and torch.compile cannot trace).

    Shapes:
        scores: (b, h, s_q, s_kv)

    Example:
        >>> p = plan_attention(h=4, h_kv=2, d_h=8, scale=8 ** -0.5, b=2, s_q=1, s_kv=9, dtype=torch.float32,
        ...                    device=torch.device("cpu"), cached=True)
        >>> p.backend, p.causal_via, p.fold_decode
        ('sdpa', 'none needed', True)
    """
    causal = causal or cached
    eager = return_weights or backend == "eager" or softcap is not None or sinks
    if not eager and records_grad:
        eager = dead_rows() if callable(dead_rows) else dead_rows
    backend = "eager" if eager else "sdpa"
    if b == 0 or s_q == 0 or s_kv == 0:
        backend = "empty"
    via = causal_mode(backend, causal, has_mask, s_q, s_kv) if causal and s_q != 1 else "none needed"
    gqa = h_kv != h
    chunk, lse, nbytes = None, False, 0
    if backend == "eager":
        nbytes = b * h * s_q * s_kv * (4 if dtype in _LOW_PRECISION else dtype.itemsize)
    elif backend == "sdpa" and not cached and not dropout_p and not records_grad:
        chunk = chunk_length(h, h_kv, d_h, b, s_q, s_kv, dtype, chunk_queries)
        if chunk is not None and causal:
            lse = not has_mask and s_kv >= s_q and lse_merge_available(device, dtype)
            via = "kernel is_causal" if lse else "explicit mask"
    fold = backend == "sdpa" and gqa and s_q == 1 and not has_mask and chunk is None
    return Plan(shape=(b, h, s_q, s_kv), backend=backend, causal_via=via, causal=causal, has_mask=has_mask,
                enable_gqa=gqa, fold_decode=fold, chunk=chunk, lse_chunks=lse, probability_bytes=nbytes,
                warn=nbytes > FORWARD_WARN_BYTES, scale=scale, dropout_p=dropout_p, cached=cached,
                return_weights=return_weights, chunk_forced=chunk_queries is not True, softcap=softcap,
                sinks=sinks)


def forward_warning(plan: Plan) -> MaterializationWarning:
    """The warning ``forward`` gives, before any work, when running a plan with ``plan.warn``."""
    b, h, s_q, s_kv = plan.shape
    return MaterializationWarning(
        f"the eager path materialises b*h*s_q*s_kv = {b}*{h}*{s_q}*{s_kv} attention probabilities "
        f"({plan.probability_bytes} bytes, above headwise.plan.FORWARD_WARN_BYTES={FORWARD_WARN_BYTES}); use "
        f"backend='sdpa' without return_weights to avoid it")
