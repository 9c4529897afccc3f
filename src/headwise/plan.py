"""One decision per call: which attention path runs, how causality is applied, whether queries are chunked.

:func:`plan_attention` is a pure function of sizes, dtypes, the device type and flags (it never reads tensor
data). The layer's ``forward`` executes the :class:`Plan` it returns; ``explain_dispatch`` formats the same plan;
nothing else decides. The rules:

1. **Empty** (b, s_q or s_kv is 0): no kernel runs; the context is zeros.
2. **Backend**: ``return_weights=True``, ``backend="eager"``, a score softcap or attention sinks take the
   eager path (:func:`headwise.functional.softmax_attention`), which materialises every head's probabilities
   (``b * h * s_q * s_kv`` floats, float32 for half-precision inputs). So does a floating mask with a row
   that is entirely at the dtype's minimum (Hugging Face's padding convention) while autograd records:
   PyTorch's fused CPU backward is wrong on such rows (docs/guarantees.md has the reproduction). Under
   ``torch.compile`` and ``torch.export`` the mask cannot be read (a data-dependent step): there every floating
   mask takes the eager path while autograd records, so the call traces whole. Everything else runs
   ``F.scaled_dot_product_attention``.
3. **Causal** (a cache forces it: new tokens read the cache and themselves), always bottom-right aligned:
   a single query reads every key, so needs no mask; with ``s_q == s_kv`` and no mask the fused kernel's own
   ``is_causal`` runs (the two alignments agree there); otherwise an explicit bottom-right mask.
4. **Rows that may read nothing** (a mask is given, or causal with ``s_q > s_kv``): on the fused path headwise
   zeros them itself after the kernel, whatever the kernel did with them (cuDNN turns a bool mask into a finite
   bias and gives such a row unmasked attention), with tensor operations only; an eager CPU call, which can
   read its mask for free, skips the zeroing when no row is dead (:func:`headwise.masks.open_dead_rows`).
5. **GQA** (``h_kv < h``): one query whose mask (if any) is the same for every head folds each group's query
   heads into query rows of its K/V head, so each K/V head is read once per group. On CUDA, where the best
   fused kernel for the inputs cannot group heads (float32, or a mask: the memory-efficient kernel), K and V
   are repeated to every query head (``b * h * s_kv * d_h`` more memory, never ``s_q * s_kv``) rather than
   falling to the math kernel; elsewhere SDPA's ``enable_gqa``.
6. **Kernels** (CUDA, half precision): an eager call whose keys come from a growing cache (the filled prefix of
   a :class:`~headwise.KVCache`, or more keys than queries: transformers' dynamic cache) does not use cuDNN,
   which builds an execution plan for every new shape (tens of milliseconds; a decode step is a new shape
   every time). Whole-buffer reads (rule 8) and compiled calls keep PyTorch's choice: their shapes repeat.
7. **Chunks** (CPU only: CUDA's fused kernels already hold O(s) memory): without autograd, on the fused path
   without dropout, cache or returned weights, a forward whose Q, K, V and context together exceed
   :data:`CHUNK_ABOVE_BYTES` runs its queries :data:`CHUNK_BYTES` at a time (:mod:`headwise.chunking`). A
   layer's ``chunk_queries`` can turn this off (False) or fix the chunk length (an int). Causal chunks without
   a mask, in float32/float64, run as a fully read key prefix plus the square diagonal block with the kernel's
   ``is_causal``, merged by log-sum-exp; elsewhere a chunk gets an explicit bottom-right mask.
8. **Cache reads** (a :class:`~headwise.KVCache` without a user mask): under ``torch.compile``, on every path
   and with or without autograd, the call writes at the cache's device position and reads its whole ``max_len``
   buffer under a position mask built on the device, so every shape and Python value is the same at every
   position and one graph (one CUDA graph) serves them all (:attr:`CacheRead.POSITION`); the new keys keep their
   autograd history there as in a prefix read, and weights returned span the ``max_len`` buffer (zero past the
   written positions). Eagerly on CUDA in half precision, a fused-path call that reads cached keys reads the
   whole buffer too, under a mask of the filled positions (:attr:`CacheRead.BUFFER`): cuDNN, the fastest kernel
   there, then builds one plan per cache instead of one per position. Elsewhere the call reads the filled
   prefix, no mask (:attr:`CacheRead.PREFIX`).
9. **Warning**: the eager path warns above :data:`FORWARD_WARN_BYTES` of probabilities, before any work.
10. **Statistics** (a trace capturing ``lse``, ``entropy``, ``max_weight`` or ``key_weight``;
    :mod:`headwise.statistics`): a call that also returns its probabilities, runs dropout or is recorded by
    autograd keeps its path for the context and computes the statistics beside it, in a separate pass of
    query chunks without gradient (:attr:`Statistics.BESIDE`). Otherwise the call's backend is
    ``"statistics"``: on CUDA with Triton installed (float32, float16, bfloat16; head widths up to 256) a fused
    kernel, one flash-attention pass for the context, lse, entropy and maximum and one key-blocked pass for the
    key weights (:attr:`Statistics.KERNEL`); elsewhere query chunks of the softmax in PyTorch operations, the
    context from the same probabilities (:attr:`Statistics.CHUNKS`). Neither materialises more than a bounded
    chunk of the pattern; softcap and sinks are applied there, not by the eager path.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length (cached positions included), h: query heads,
    h_kv: key/value heads, d: model width, d_h: head width.
"""

from __future__ import annotations

import enum
from typing import Callable, NamedTuple

import torch


__all__ = ["Plan", "Causal", "Grouping", "CacheRead", "Statistics", "STATISTICS", "statistics_rows", "plan_attention",
           "cache_read", "MaterializationWarning", "forward_warning", "CHUNK_ABOVE_BYTES", "CHUNK_BYTES",
           "FORWARD_WARN_BYTES", "lse_merge_available"]

#: Chunk a forward whose unchunked Q, K, V and context together would take more than this (512 MiB).
CHUNK_ABOVE_BYTES = 512 * 2**20
#: Target size of one chunk's queries (16 MiB): 1024 positions at b 1, d 4096 in float32.
CHUNK_BYTES = 16 * 2**20
#: Chunks are a multiple of this many positions (the CPU flash kernel's query block), and never shorter.
CHUNK_ALIGN = 256
#: forward() on the eager path warns when it would materialise more probability bytes than this (1 GiB).
FORWARD_WARN_BYTES = 2**30

_LOW_PRECISION = (torch.float16, torch.bfloat16)
#: The per-head statistics a call can compute without materialising its pattern (rule 10).
STATISTICS = ("lse", "entropy", "max_weight", "key_weight")
#: The widest head the statistics kernel takes (its tiles hold a whole head).
KERNEL_MAX_D_HEAD = 256
#: Query chunks of the statistics (rule 10) hold scores of about this size (b * h * rows * keys floats): large
#: enough that a chunk's products run at full speed, tiny beside the pattern.
STATISTICS_CHUNK_BYTES = 16 * 2**20


class MaterializationWarning(UserWarning):
    """A path would materialise ``b * h * s_q * s_kv`` attention probabilities above a size threshold."""


class Causal(str, enum.Enum):
    """How causality is applied (rule 3). A ``str`` enum: each member equals its description."""

    NONE = "none needed"
    KERNEL = "kernel is_causal"
    MASK = "explicit mask"


class Grouping(str, enum.Enum):
    """How query heads reach their shared K/V head under GQA/MQA (rule 5)."""

    NONE = "one K/V head per query head"
    KERNEL = "SDPA's enable_gqa"
    FOLD = "query heads folded into rows of their K/V head"
    REPEAT = "K/V repeated to every query head"


class CacheRead(str, enum.Enum):
    """Which keys a cached call reads (rule 8)."""

    NONE = "no cache"
    PREFIX = "the filled prefix"
    BUFFER = "the whole buffer under a mask of the filled positions"
    POSITION = "the whole buffer, written at the device position, under a position mask"


class Statistics(str, enum.Enum):
    """How a call computes per-head statistics (rule 10)."""

    NONE = "none asked"
    BESIDE = "the call's own path for the context; a separate no-grad pass of query chunks for the statistics"
    CHUNKS = "query chunks of the softmax (PyTorch operations); the context from the same probabilities"
    KERNEL = ("a fused Triton kernel: one flash-attention pass for the context, lse, entropy and maximum, a "
              "key-blocked pass for the key weights")


def statistics_kernel_available() -> bool:
    """Whether Triton is installed (the statistics kernel's compiler); asked only for CUDA calls."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def statistics_rows(b: int, h: int, s_q: int, s_kv: int, itemsize: int = 4) -> int:
    """Query rows per chunk of the statistics' chunked pass (rule 10): scores of at most
    :data:`STATISTICS_CHUNK_BYTES`, a multiple of 8 rows, at least 8, at most ``s_q``. The floor of 8 rows is
    for speed: a chunk of fewer rows reads every key and value for each of its rows as a matrix-vector product
    (several times slower at long context), so where 8 rows exceed the budget (``8 * b * h * s_kv`` floats:
    128 MiB at 32 heads and 128k keys, beside 4 GiB of float32 keys and values) a chunk is 8 rows.

    Shapes:
        scores of one chunk: (b, h, rows, s_kv)

    Example:
        >>> statistics_rows(1, 12, 8192, 8192)
        40
        >>> statistics_rows(1, 4, 100, 64)
        100
        >>> statistics_rows(1, 64, 131072, 131072)   # 32 MiB a row: beyond the 16 MiB budget, the 8-row floor
        8
    """
    per_row = max(1, b * h * s_kv * itemsize)
    rows = max(8, STATISTICS_CHUNK_BYTES // per_row // 8 * 8)
    return min(rows, max(s_q, 1))


class Plan(NamedTuple):
    """What one attention call runs (a NamedTuple so ``torch.compile`` traces it as constants).

    Attributes:
        shape: ``(b, h, s_q, s_kv)`` of the scores, cached positions included (``max_len`` when the call reads a
            cache's whole buffer).
        backend: ``"sdpa"``, ``"eager"`` or ``"empty"``.
        causal_via: a :class:`Causal`: no mask needed, the kernel's ``is_causal``, or an explicit mask.
        causal: whether the call is causal at all (given, or forced by a cache).
        has_mask: whether a user mask is applied.
        grouping: a :class:`Grouping`, from the head counts (h != h_kv), never from tensor shapes.
        chunk: query positions per chunk, or None for one pass.
        lse_chunks: causal chunks merge a key prefix and the diagonal block by log-sum-exp.
        probability_bytes: bytes of probabilities the eager path materialises (0 on the fused path; the
            SDPA math kernel's own buffers are PyTorch's choice, reported by ``explain_dispatch``).
        warn: forward warns (:class:`headwise.MaterializationWarning`) before running.
        scale: the score scale; dropout_p: dropout on the probabilities (0 outside training).
        cached: a KV cache supplies earlier positions; return_weights: the call returns probabilities.
        chunk_forced: the layer fixed the chunk length (``chunk_queries`` is an int).
        softcap: the score softcap or None; sinks: the call adds one sink logit per head.
        avoid_cudnn: SDPA may not use cuDNN for this call (rule 6); otherwise PyTorch chooses.
        zero_dead_rows: rows that may read nothing are zeroed after the fused kernel (rule 4).
        cache_read: how a cached call reads the cache (a :class:`CacheRead`, rule 8).
        device_type: the device the plan was made for (``"cpu"``, ``"cuda"``, ...).
        statistics: the per-head statistics the call computes (names from :data:`STATISTICS`), in that order.
        statistics_via: how it computes them (a :class:`Statistics`, rule 10).
        min_rows_eager: the eager path runs because autograd records a floating mask row entirely at the
            dtype's minimum (rule 2).
        hooked: the call would run in query chunks, but q_proj or out_proj has forward hooks, which must see
            every row in one call: one pass instead.
    """

    shape: tuple[int, int, int, int]
    backend: str
    causal_via: Causal
    causal: bool
    has_mask: bool
    grouping: Grouping
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
    avoid_cudnn: bool = False
    zero_dead_rows: bool = False
    cache_read: CacheRead = CacheRead.NONE
    device_type: str = "cpu"
    statistics: tuple[str, ...] = ()
    statistics_via: Statistics = Statistics.NONE
    min_rows_eager: bool = False
    hooked: bool = False

    @property
    def is_causal(self) -> bool:
        """SDPA's ``is_causal`` flag."""
        return self.causal_via is Causal.KERNEL

    @property
    def enable_gqa(self) -> bool:
        """SDPA's ``enable_gqa`` flag."""
        return self.grouping is Grouping.KERNEL

    @property
    def fold_decode(self) -> bool:
        """One query under GQA/MQA: a group's query heads become query rows of its K/V head."""
        return self.grouping is Grouping.FOLD

    def for_chunk(self, s_q: int, s_kv: int) -> "Plan":
        """The plan of one query chunk attending to its ``s_kv`` readable keys (one pass, same rules)."""
        b, h = self.shape[0], self.shape[1]
        if s_kv == 0:  # causal queries before the first key (s_q > s_kv): they read nothing, as in one pass
            return self._replace(shape=(b, h, s_q, 0), backend="empty", causal_via=Causal.NONE, chunk=None,
                                 lse_chunks=False, zero_dead_rows=False)
        via = causal_mode(self.backend, self.causal, self.has_mask, s_q, s_kv)
        # The chunk's own rule 4: a square causal chunk (the kernel's is_causal) has no dead row and no mask.
        dead = self.backend == "sdpa" and (self.has_mask or (self.causal and s_q > s_kv))
        return self._replace(shape=(b, h, s_q, s_kv), causal_via=via, chunk=None, lse_chunks=False,
                             zero_dead_rows=dead)


def causal_mode(backend: str, causal: bool, has_mask: bool, s_q: int, s_kv: int) -> Causal:
    """How causality is applied (rule 3 of the module docstring)."""
    if not causal or s_q == 1:
        return Causal.NONE
    if backend == "sdpa" and not has_mask and s_q == s_kv:
        return Causal.KERNEL
    return Causal.MASK


def cache_read(device_type: str, dtype: torch.dtype, s_q: int, has_mask: bool, eager: bool,
               cached_length: Callable[[], int]) -> CacheRead:
    """How a cached call of ``s_q`` new positions reads its cache (rule 8). ``eager``: the call takes the eager
    path or autograd records it (outside compilation it reads the prefix, where the new keys keep their history;
    compiled, it reads at the device position all the same). ``cached_length``
    is asked only in eager code, and only for several new positions (compiled code must not read the host's
    length: it changes at every position); a first prefill (nothing cached yet) keeps the kernel's own causal path.

    Example:
        >>> cache_read("cuda", torch.bfloat16, 1, False, False, lambda: 1024).name    # an eager decode step
        'BUFFER'
        >>> cache_read("cuda", torch.bfloat16, 128, False, False, lambda: 0).name     # a first prefill
        'PREFIX'
        >>> cache_read("cpu", torch.float32, 1, False, False, lambda: 1024).name
        'PREFIX'
    """
    if has_mask:
        return CacheRead.PREFIX
    if torch.compiler.is_compiling():
        # Before ``eager``: a prefix read under compilation guards on the host's length, a new graph per position
        # (and a hard failure past the recompile limit under fullgraph), whatever path attends over it. The
        # position route keeps the new keys' history (KVCache.write_static), so autograd gets the eager gradients.
        return CacheRead.POSITION
    if eager:
        return CacheRead.PREFIX
    if device_type == "cuda" and dtype in _LOW_PRECISION and (s_q == 1 or cached_length() > 0):
        return CacheRead.BUFFER
    return CacheRead.PREFIX


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
    """Query positions per chunk for a forward of these sizes (rule 7), or None for one pass.

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
    dead_rows: bool | Callable[[tuple[int, int] | None], bool] = False, mask_per_head: bool = False, read: CacheRead = CacheRead.NONE,
    statistics: tuple[str, ...] | frozenset[str] = (),
) -> Plan:
    """The plan of one attention call (see the module docstring for the rules). Inputs are trusted: the
    caller validated them (``MultiHeadAttention.forward`` and ``functional.attention`` do).

    Args:
        h, h_kv, d_h: query heads, key/value heads, head width; scale: the score scale.
        b, s_q, s_kv: batch, query length, key length (cached positions included; ``max_len`` for a whole-buffer
            read).
        dtype, device: of the queries (only the device's type is read).
        backend: the layer's backend, ``"sdpa"`` or ``"eager"``.
        causal: causal attention was asked for (a cache forces it).
        has_mask: a mask is given.
        cached: a KV cache supplies the keys.
        return_weights: per-head probabilities are returned.
        dropout_p: dropout on the probabilities (0 outside training).
        chunk_queries: the layer's chunking setting (see :func:`chunk_length`).
        records_grad: autograd records this call (no chunks then: a backward keeps every chunk).
        softcap, sinks: a score softcap, attention sinks (both run eager).
        dead_rows: the floating mask has a row entirely at the dtype's minimum (rule 2), counting only the keys
            the row may read; a callable is asked only when its answer can change the backend (reading the mask
            is a data-dependent step, which torch.export and torch.compile cannot trace), and is given
            ``(s_q, s_kv)`` of a causal call (whose blocked keys a row does not read) or None.
        mask_per_head: the mask has a head axis (it differs between query heads of one group).
        read: how a cached call reads the cache (:func:`cache_read`); for a whole-buffer read ``s_kv`` is
            ``max_len``, ``has_mask`` is True (the position mask) and causality is in that mask.
        statistics: per-head statistics to compute (names from :data:`STATISTICS`, a tuple in that order, or a
            set; rule 10).

    Shapes:
        scores: (b, h, s_q, s_kv)

    Example:
        >>> p = plan_attention(h=4, h_kv=2, d_h=8, scale=8 ** -0.5, b=2, s_q=1, s_kv=9, dtype=torch.float32,
        ...                    device=torch.device("cpu"), cached=True)
        >>> p.backend, p.causal_via.value, p.grouping.name, p.avoid_cudnn
        ('sdpa', 'none needed', 'FOLD', False)
        >>> p = plan_attention(h=4, h_kv=2, d_h=8, scale=8 ** -0.5, b=2, s_q=1, s_kv=9, dtype=torch.bfloat16,
        ...                    device=torch.device("cuda"), cached=True)
        >>> p.avoid_cudnn                               # a prefix read never waits for a cuDNN plan per position
        True
        >>> cuda = dict(h=32, h_kv=8, d_h=128, scale=0.088, b=8, s_q=4096, s_kv=4096, device=torch.device("cuda"))
        >>> plan_attention(dtype=torch.float32, **cuda).grouping.name     # the efficient kernel: K/V repeated
        'REPEAT'
        >>> plan_attention(dtype=torch.bfloat16, **cuda).grouping.name    # flash groups heads itself
        'KERNEL'
        >>> plan_attention(dtype=torch.bfloat16, **cuda).chunk is None    # no query chunks on CUDA
        True
        >>> p = plan_attention(statistics=("entropy",), dtype=torch.float32, **dict(cuda, device=torch.device("cpu")))
        >>> p.backend, p.statistics_via.name, p.probability_bytes
        ('statistics', 'CHUNKS', 0)
    """
    device_type = device.type
    causal = causal or cached
    wanted = statistics if isinstance(statistics, tuple) else tuple(n for n in STATISTICS if n in statistics)
    stats_via = Statistics.NONE
    if wanted:
        if return_weights or dropout_p or records_grad:
            stats_via = Statistics.BESIDE
        elif device_type == "cuda" and d_h <= KERNEL_MAX_D_HEAD and dtype in (torch.float32, *_LOW_PRECISION) \
                and statistics_kernel_available():
            stats_via = Statistics.KERNEL
        else:
            stats_via = Statistics.CHUNKS
    eager = return_weights or backend == "eager" or softcap is not None or sinks
    min_rows = False
    if not eager and records_grad:
        min_rows = eager = dead_rows((s_q, s_kv) if causal else None) if callable(dead_rows) else dead_rows
    backend = "eager" if eager else "sdpa"
    if stats_via is Statistics.CHUNKS or stats_via is Statistics.KERNEL:
        backend = "statistics"
    if b == 0 or s_q == 0 or s_kv == 0:
        backend = "empty"
    whole = read is CacheRead.BUFFER or read is CacheRead.POSITION
    if whole:
        via = Causal.NONE  # the position mask holds causality
    else:
        via = causal_mode(backend, causal, has_mask, s_q, s_kv) if causal and s_q != 1 else Causal.NONE
    chunk, lse, nbytes = None, False, 0
    if backend == "eager":
        nbytes = b * h * s_q * s_kv * (4 if dtype in _LOW_PRECISION else dtype.itemsize)
    elif backend == "sdpa" and device_type == "cpu" and not cached and not dropout_p and not records_grad:
        chunk = None if chunk_queries is False else chunk_length(h, h_kv, d_h, b, s_q, s_kv, dtype, chunk_queries)
        if chunk is not None and causal:
            lse = not has_mask and s_kv >= s_q and lse_merge_available(device, dtype)
            via = Causal.KERNEL if lse else Causal.MASK
    kernel_mask = has_mask or via is Causal.MASK
    group = Grouping.NONE
    if h_kv != h:
        if backend != "sdpa":
            group = Grouping.KERNEL  # the eager formula groups heads itself
        elif s_q == 1 and not mask_per_head:
            group = Grouping.FOLD
        elif device_type == "cuda" and (dtype == torch.float32 or (dtype in _LOW_PRECISION and kernel_mask)):
            group = Grouping.REPEAT  # the memory-efficient kernel, which cannot group heads, is the best fused one
        else:
            group = Grouping.KERNEL
    dead = backend == "sdpa" and not whole and (has_mask or (causal and s_q > s_kv))
    avoid = (backend == "sdpa" and device_type == "cuda" and dtype in _LOW_PRECISION and not whole
             and (cached or s_q < s_kv) and not torch.compiler.is_compiling())
    return Plan(shape=(b, h, s_q, s_kv), backend=backend, causal_via=via, causal=causal, has_mask=has_mask,
                grouping=group, chunk=chunk, lse_chunks=lse, probability_bytes=nbytes,
                warn=nbytes > FORWARD_WARN_BYTES, scale=scale, dropout_p=dropout_p, cached=cached,
                return_weights=return_weights, chunk_forced=chunk_queries is not True, softcap=softcap,
                sinks=sinks, avoid_cudnn=avoid, zero_dead_rows=dead, cache_read=read,
                device_type=device_type, statistics=wanted, statistics_via=stats_via,
                min_rows_eager=bool(min_rows) and backend == "eager")


def forward_warning(plan: Plan) -> MaterializationWarning:
    """The warning ``forward`` gives, before any work, when running a plan with ``plan.warn``."""
    b, h, s_q, s_kv = plan.shape
    return MaterializationWarning(
        f"the eager path materialises b*h*s_q*s_kv = {b}*{h}*{s_q}*{s_kv} attention probabilities "
        f"({plan.probability_bytes} bytes, above headwise.plan.FORWARD_WARN_BYTES={FORWARD_WARN_BYTES}); use "
        f"backend='sdpa' without return_weights to avoid it")
