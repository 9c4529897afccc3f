"""Per-head attention statistics without the pattern: ``lse``, ``entropy``, ``max_weight``, ``key_weight``.

Most questions asked of an attention pattern need far less than its ``b * h * s_q * s_kv`` floats. For every
query row of every head, with ``p_j`` its weight on key ``j`` (after the mask, softcap and sinks):

* ``lse`` (b, h, s_q): the log-sum-exp of the row's scores, sinks included: ``p_j = exp(score_j - lse)``;
* ``entropy`` (b, h, s_q): ``-sum_j p_j log p_j`` (natural log) over the keys the row may read;
* ``max_weight`` (b, h, s_q): ``max_j p_j = exp(max score - lse)``;
* ``key_weight`` (b, h, s_kv): each key's weight summed over the call's query rows (the total attention a key
  receives, what KV-cache eviction methods such as H2O rank by).

An attention sink (a logit per head or per row that takes probability and carries no value) is mass on no
key: it is in ``lse``, and a row's weights then sum to ``1 - sink share``. A row that may read nothing (every
key masked off) gives ``lse = -inf``, entropy and maximum 0, and adds nothing to ``key_weight``; without sinks
``key_weight`` summed over the keys is the number of rows that read something.

:func:`attend_with_statistics` runs a :class:`~headwise.plan.Plan` that asks for statistics (rule 10 of
:mod:`headwise.plan`): the context ``z`` and the statistics, never more than a bounded chunk of the pattern in
memory. The statistics carry no gradient. In float32 and float64 the layer's output is the one it computes
without them, to floating-point rounding (the same values summed in another order). In float16 and bfloat16
the context is computed with float32 accumulation and rounded once to the dtype, so the output may differ from
the untraced one by about a unit in the last place of the dtype (measured on a small layer: at most 2.4e-4 in
float16 and 3.9e-3 in bfloat16 on outputs of order 1).

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d_h: query/key head width, d_v: value head width.

Example:
    >>> import torch
    >>> from headwise.plan import plan_attention
    >>> q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    >>> plan = plan_attention(h=2, h_kv=2, d_h=8, scale=8 ** -0.5, b=1, s_q=4, s_kv=4, dtype=q.dtype,
    ...                       device=q.device, causal=True, statistics=("entropy", "key_weight"))
    >>> z, _, stats = attend_with_statistics(plan, q, k, v)
    >>> float(stats["entropy"][0, 0, 0])                  # the first query reads one key
    0.0
    >>> stats["key_weight"].sum(-1).round(decimals=4).tolist()   # every row reads something
    [[4.0, 4.0]]
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..functional import attend
from ..plan import STATISTICS, CacheRead, Plan, Statistics
from .chunks import chunked_statistics

__all__ = ["STATISTICS", "attend_with_statistics", "check_statistics", "empty_statistics", "concatenate",
           "KernelFallbackWarning"]


class KernelFallbackWarning(UserWarning):
    """The statistics kernel failed to build or run on this device; the call used query chunks instead."""


def check_statistics(names: object) -> tuple[str, ...]:
    """Statistic names (a tuple, list or set of names from :data:`STATISTICS`, or one name) in canonical order;
    anything else is a ``TypeError`` / ``ValueError`` naming what is accepted.

    Example:
        >>> check_statistics(["key_weight", "lse"])
        ('lse', 'key_weight')
    """
    items = (names,) if isinstance(names, str) else names
    if not isinstance(items, (tuple, list, set, frozenset)):
        raise TypeError(f"statistics takes names from {STATISTICS} (a tuple), got {type(names).__name__}")
    bad = [n for n in items if n not in STATISTICS]
    if bad:
        raise ValueError(f"statistics: {bad} are not statistics; choose from {STATISTICS}")
    return tuple(n for n in STATISTICS if n in items)


def empty_statistics(names: tuple[str, ...], b: int, h: int, s_q: int, s_kv: int, device: torch.device,
                     dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The statistics of rows that read nothing: lse -inf, everything else 0.

    Shapes: -> lse, entropy, max_weight (b, h, s_q); key_weight (b, h, s_kv)"""
    out = {}
    for n in names:
        if n == "key_weight":
            out[n] = torch.zeros(b, h, s_kv, dtype=dtype, device=device)
        else:
            out[n] = torch.full((b, h, s_q), float("-inf") if n == "lse" else 0.0, dtype=dtype, device=device)
    return out


def attend_with_statistics(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """Run ``plan`` (which asks for ``plan.statistics``): the context, the weights (only where the plan returns
    them) and the statistics by name. Inputs are trusted, as for :func:`headwise.functional.attend`.

    Shapes:
        q: (b, h, s_q, d_h); k: (b, h_kv, s_kv, d_h); v: (b, h_kv, s_kv, d_v); mask: 4-D, broadcastable to
        (b, h, s_q, s_kv); sinks: (h,) or (b or 1, h, s_q or 1, 1)
        -> z (b, h, s_q, d_v), weights (b, h, s_q, s_kv) or None, {name: (b, h, s_q) or (b, h, s_kv)}
    """
    b, h, s_q, s_kv = plan.shape
    names = plan.statistics
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if plan.backend == "empty":
        z, weights = attend(plan, q, k, v, mask, sinks)
        return z, weights, empty_statistics(names, b, h, s_q, s_kv, q.device, acc)
    # A whole-buffer cache read carries causality in its position mask (plan rule 8).
    causal = plan.causal and plan.cache_read not in (CacheRead.BUFFER, CacheRead.POSITION)
    kw = dict(scale=plan.scale, mask=mask, causal=causal, softcap=plan.softcap, sinks=sinks, names=names)
    if plan.statistics_via is Statistics.BESIDE:
        z, weights = attend(plan, q, k, v, mask, sinks)
        with torch.no_grad():
            _, stats = chunked_statistics(q.detach(), k.detach(), v.detach(), need_z=False,
                                          **{**kw, "sinks": None if sinks is None else sinks.detach()})
        return z, weights, stats
    if plan.statistics_via is Statistics.KERNEL:
        try:
            from .kernel import kernel_statistics

            z, stats = kernel_statistics(q, k, v, **kw)
            return z, None, stats
        except Exception as exc:  # noqa: BLE001 - a compiler or driver failure: the chunks compute the same
            warnings.warn(KernelFallbackWarning(
                f"the statistics kernel failed on {q.device} ({type(exc).__name__}: {str(exc)[:300]}); this call "
                "computed its statistics in query chunks instead"), stacklevel=3)
    with torch.no_grad():
        z, stats = chunked_statistics(q, k, v, **kw)
    return z, None, stats


def concatenate(name: str, calls: list[torch.Tensor], queries: list[int] | None = None) -> torch.Tensor:
    """One statistic over several calls of a layer (decoding): ``lse``, ``entropy`` and ``max_weight`` joined
    along the query positions; ``key_weight`` summed per key position, each call's padded with zeros to the
    longest call's keys (the total attention each key received over every query of the generation).

    A call that reads fewer keys than an earlier one (a cache that drops or rolls keys, such as a sliding-window
    cache) has no position-by-position sum: refused with a ``ValueError``. Given ``queries`` (each call's s_q),
    so is a call that reads as many keys as the one before after keys were seen to grow by appending (each
    s_kv_i == s_kv_{i-1} + s_q_i): a self-attention cache that stopped growing rolled its window, and its key
    positions no longer name the same tokens. Keys that never grew (cross-attention reading the same encoder
    keys again) and calls that read exactly their own queries (s_kv_i == s_q_i, recomputed from position 0) sum.
    The result has the calls' promoted dtype (a float64 call after a float32 one is summed in float64).

    Args:
        name: the statistic, one of :data:`STATISTICS`.
        calls: each call's ``(b, h, n)`` tensor of it, in call order, all of one ``(b, h)``.
        queries: each call's s_q, one int per call (another length: ``ValueError``; not ints: ``TypeError``).

    Shapes: each (b, h, s_q_i) -> (b, h, sum s_q_i); key_weight each (b, h, s_kv_i) -> (b, h, max s_kv_i)

    Example:
        >>> concatenate("key_weight", [torch.ones(1, 1, 2), torch.ones(1, 1, 3)]).tolist()
        [[[2.0, 2.0, 1.0]]]
    """
    if name not in STATISTICS:
        raise ValueError(f"{name!r} is not a statistic; choose from {STATISTICS}")
    if len(calls) == 0:
        raise ValueError(f"{name}: calls must hold at least one call's (b, h, n) tensor, got none")
    for i, t in enumerate(calls):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: every call must be a (b, h, n) tensor, but call {i} is {got}")
    for i, t in enumerate(calls[1:], 1):
        # (b, h) must agree: a batch-1 call would otherwise be broadcast onto every row of another batch
        if t.shape[:2] != calls[0].shape[:2]:
            raise ValueError(f"{name}: every call must have the same (b, h) to be joined, but call 0 is "
                             f"{tuple(calls[0].shape)} and call {i} is {tuple(t.shape)} (calls of different batch "
                             f"sizes); use .calls[i][{name!r}]")
    if queries is not None:
        if not isinstance(queries, (list, tuple)):
            raise TypeError(f"{name}: queries must be a list of ints (each call's s_q), got {type(queries).__name__}")
        if len(queries) != len(calls):
            raise ValueError(f"{name}: queries must hold one s_q per call, {len(calls)} for {len(calls)} calls, but "
                             f"holds {len(queries)}: {list(queries)}")
        for i, n in enumerate(queries):
            if not isinstance(n, int) or isinstance(n, bool):
                raise TypeError(f"{name}: queries must be ints (each call's s_q), but queries[{i}] is "
                                f"{type(n).__name__} ({n!r})")
    if name != "key_weight":
        return torch.cat(calls, dim=2)
    lengths = [t.shape[-1] for t in calls]
    if any(b < a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"key_weight: the calls read {lengths} keys, fewer in a later call than in an earlier one "
                         "(a cache that drops keys): there is no sum per key position; use .calls[i]['key_weight']")
    if queries is not None:
        grew = False
        for i in range(1, len(lengths)):
            appended = lengths[i] == lengths[i - 1] + queries[i]
            if lengths[i] == lengths[i - 1] and grew and lengths[i] != queries[i]:
                raise ValueError(
                    f"key_weight: the calls read {lengths} keys for {list(queries)} queries: the keys grew by "
                    f"appending, then call {i} read {lengths[i]} keys again for {queries[i]} new queries (a rolling "
                    "sliding-window cache that drops its oldest keys): there is no sum per key position; use "
                    ".calls[i]['key_weight']")
            grew = grew or appended
    # every call's own precision kept: a float64 call after a float32 one is summed in float64 (as cat promotes)
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in calls))
    total = calls[0].new_zeros(*calls[0].shape[:-1], max(lengths), dtype=dtype)
    for t in calls:
        total[..., :t.shape[-1]] += t
    return total
