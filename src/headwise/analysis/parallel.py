"""Per-rank memory and communication of one self-attention layer split over P ranks: tensor parallelism (heads
split, sequence replicated) versus sequence parallelism (sequence split, heads swapped in by all-to-alls).

Closed forms, no torch; the head split comes from :mod:`headwise.parallel.plan` and
:mod:`headwise.parallel.sequence_plan` (the arithmetic the layers run). Per rank and per layer:

* tensor parallel (:func:`headwise.parallel.tensor_parallel`): weights of ``h / P`` query heads and their
  K/V heads; the full ``(b, S, d)`` input and output on every rank; one all-reduce of ``(b, S, d)`` forward and
  one backward (a ring all-reduce sends ``2 (P - 1) / P`` of its buffer); replicated K/V heads add one
  all-reduce of their weight gradients per step.
* sequence parallel (:func:`headwise.parallel.sequence_parallel`): all weights (replicated); a ``(b, S/P, d)``
  slice in and out; the attention step holds the whole sequence, unpadded (the layer removes the padding of
  uneven slices before attention), for ``ceil(h / P)`` heads (and for as many K/V heads where a rank repeats its
  K/V heads per query head); the all-to-alls, on padded slices, send what
  :meth:`~headwise.parallel.sequence_plan.SequenceParallelPlan.all_to_all_bytes` says (the backward sends
  back what a rank received: the same amount where every rank attends with as many heads); the weight
  gradients are all-reduced once per step. Bytes sent are the largest over ranks, forward and backward each.

The largest over ranks is found without visiting the ranks (there may be 2**63 - 1 heads): the ranks with as many
heads form two runs whose first heads step by the same amount, and which K/V heads a rank reads depends on where
its first head falls in its K/V group, counted over a run by :func:`_count_residues` in O(log) steps.

Shapes:
    b: batch, S: sequence, P: ranks, h / h_kv: query / K/V heads, h_r / kv_r: those one rank attends with,
    d: d_model, d_h: d_head; s = ceil(S / P): a padded slice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config import AttentionConfig
from ..parallel.plan import split_summary
from ..parallel.sequence_plan import plan_sequence_parallel
from .flops import check_positive
from .memory import dtype_info, lse_itemsize, probability_itemsize
from .params import check_config, param_count

if TYPE_CHECKING:
    import torch

__all__ = ["parallel_costs", "ring_all_reduce_bytes"]


def ring_all_reduce_bytes(nbytes: int, ranks: int) -> int:
    """Bytes one rank sends in a ring all-reduce of an ``nbytes`` buffer: ``2 (P - 1) / P * nbytes``.

    Example:
        >>> ring_all_reduce_bytes(1000, 4), ring_all_reduce_bytes(1000, 1)
        (1500, 0)
    """
    return 2 * (ranks - 1) * nbytes // ranks


def _tp(c: AttentionConfig, b: int, s: int, p: int, item: int, p_item: int, lse_item: int,
        held: int) -> dict[str, Any]:
    line = split_summary(c.n_heads, c.n_kv_heads, p)  # raises for a split that cannot work
    # plan_heads' split in closed form (the plan itself lists every head of every rank).
    h_r, replicated, d_h = c.n_heads // p, c.n_kv_heads < p, c.d_head
    kv_r = 1 if replicated else c.n_kv_heads // p
    q = c.d_model * h_r * d_h + (h_r * d_h if c.bias else 0)
    kv = (c.kdim + c.vdim) * kv_r * d_h + (2 * kv_r * d_h if c.bias else 0)
    out = h_r * d_h * c.d_model + (c.d_model if c.out_bias else 0)
    kv_grads = (c.kdim + c.vdim + (2 if c.bias else 0)) * c.n_kv_heads * d_h * item if replicated else 0
    io = b * s * c.d_model * item
    return {
        "heads": h_r, "kv_heads": kv_r, "weights": (q + kv + out) * item, "input_output": 2 * io,
        "qkv_context": b * s * (2 * h_r + 2 * kv_r) * d_h * item,
        "probabilities_eager": b * h_r * s * s * p_item, "lse_fused": b * h_r * s * lse_item,
        "kv_cache": 2 * b * held * kv_r * d_h * item,  # the positions the cache holds: a window's at most
        "sent_forward": ring_all_reduce_bytes(io, p), "sent_backward": ring_all_reduce_bytes(io, p),
        "weight_grad_all_reduce": ring_all_reduce_bytes(kv_grads, p),
        "plan": line,
    }


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum(floor((a * i + b) / m) for i in range(n))`` for ``m >= 1`` in O(log m) steps (Euclid's recursion)."""
    total = 0
    while n > 0:
        qa, a = divmod(a, m)
        qb, b = divmod(b, m)
        total += qa * n * (n - 1) // 2 + qb * n
        top = a * n + b
        if top < m:
            break
        n, b, m, a = top // m, top % m, a, m
    return total


def _count_residues(n: int, step: int, first: int, g: int, lo: int, hi: int) -> int:
    """How many ``i`` in ``range(n)`` have ``(first + step * i) % g`` in ``[lo, hi]`` (``0 <= lo``, ``hi < g``)."""
    if lo > hi:
        return 0
    # [(y % g) < x] == floor(y / g) - floor((y - x) / g) for 0 <= x <= g: a difference of two floor sums
    return _floor_sum(n, g, step, first - lo) - _floor_sum(n, g, step, first - hi - 1)


def _run_of_ranks(n_ranks: int, n: int, first: int, g: int) -> dict[str, int]:
    """K/V heads of a run of ``n_ranks`` ranks with ``n`` query heads each, the first starting at query head
    ``first`` (and each next ``n`` further on), ``g`` query heads per K/V head: the fewest and most any rank
    reads, their sum, and how many ranks read theirs in the plain GQA pattern (``SequenceRank.grouped``)."""
    # A rank whose first head sits at t = first_head % g reads k = q + 1 + [t >= g - m] K/V heads.
    q, m = divmod(n - 1, g)

    def count(lo: int, hi: int) -> int:  # ranks of the run whose first head sits at t in [lo, hi]
        return _count_residues(n_ranks, n, first, g, lo, hi)

    more = count(g - m, g - 1) if m else 0
    # Grouped: one K/V head (t <= g - n, when n <= g); two halves of n / 2 each (t = g - n / 2); or whole groups
    # from a group's first head (t = 0, g | n). Any other rank repeats its K/V heads per query head.
    spans = [(0, g - n)] if n <= g else []
    points = {t for t, ok in ((g - n // 2, n % 2 == 0 and n <= 2 * g), (0, n % g == 0)) if ok}
    grouped = sum(count(lo, hi) for lo, hi in spans) + sum(count(t, t) for t in points
                                                           if not any(lo <= t <= hi for lo, hi in spans))
    return {"k_min": q + 1 if more < n_ranks else q + 2, "k_max": q + 2 if more else q + 1,
            "k_sum": n_ranks * (q + 1) + more, "grouped": grouped}


def _sp(c: AttentionConfig, b: int, s: int, p: int, item: int, p_item: int, lse_item: int,
        held: int) -> dict[str, Any]:
    h, h_kv = c.n_heads, c.n_kv_heads
    if p > h:
        plan_sequence_parallel(h, h_kv, sp=p)  # raises, naming the layouts that work
    # plan_sequence_parallel's split in closed form (the plan itself lists every head of every rank): ranks
    # 0 .. h % p - 1 take one head more.
    few, extra = divmod(h, p)
    runs = [(n_ranks, n, _run_of_ranks(n_ranks, n, first, h // h_kv))
            for n_ranks, n, first in ((extra, few + 1, 0), (p - extra, few, extra * (few + 1))) if n_ranks]
    k_total = sum(r["k_sum"] for _, _, r in runs)
    s_loc = -(-s // p)  # ceil: uneven slices are padded to the longest for the all-to-alls
    row = b * s_loc * c.d_head * item
    # A rank whose K/V heads do not follow the plain GQA pattern repeats them to one per query head: 4n heads.
    attended = max(4 * n if r["grouped"] < n_ranks else 2 * n + 2 * r["k_max"] for n_ranks, n, r in runs)
    # all_to_all_bytes of a rank with n query heads reading k K/V heads, the largest over ranks each way on its
    # own: with uneven head counts the rank that sends most forward is not the one that sends most backward.
    sent_forward = max((h - n) + 2 * (k_total - r["k_min"]) + n * (p - 1) for _, n, r in runs) * row
    sent_backward = max(n * (p - 1) + 2 * r["k_max"] * (p - 1) + (h - n) for _, n, r in runs) * row
    weights = param_count(c).total * item
    h_r = few + (1 if extra else 0)
    sizes = " or ".join(str(n) for _, n, _ in runs)
    # SequenceParallelPlan.describe()'s first line, from the counts: the plan would list every head of every
    # rank (tests/analysis/test_parallel_costs.py holds the two equal).
    line = (f"sequence parallel over {p} rank{'s' if p > 1 else ''} (tp 1): {h} query heads, {h_kv} K/V "
            f"head{'s' if h_kv > 1 else ''} ({c.kind}); {sizes} query head{'s' if h_r > 1 else ''} per rank during "
            f"attention{' (uneven: the first ranks take one more)' if extra else ''}; "
            + ("K/V heads replicated (a K/V head goes to every rank whose query heads read it)" if k_total > h_kv
               else "K/V heads partitioned, none sent twice"))
    return {
        "heads": h_r, "kv_heads": max(r["k_max"] for _, _, r in runs), "weights": weights,
        "input_output": 2 * b * s_loc * c.d_model * item,
        "qkv_context": b * s * attended * c.d_head * item,  # the whole sequence, unpadded
        "probabilities_eager": b * h_r * s * s * p_item, "lse_fused": b * h_r * s * lse_item,
        "kv_cache": None,
        "sent_forward": sent_forward, "sent_backward": sent_backward,
        "weight_grad_all_reduce": ring_all_reduce_bytes(weights, p),
        "plan": line,
    }


def parallel_costs(config: AttentionConfig, seq_len: int, ranks: int, *, batch: int = 1,
                   dtype: "torch.dtype | str" = "float16", sliding_window: int | None = None) -> dict[str, Any]:
    """Per-rank bytes of one layer over ``ranks`` ranks under tensor and under sequence parallelism.

    ``sliding_window``: the layer attends to at most this many positions, so its KV cache holds
    ``min(seq_len, sliding_window)`` (as :func:`~headwise.analysis.summarize` counts it).

    ``"tp"`` / ``"sp"`` hold the figures (module doc), or ``{"error": why}`` when that split is impossible.
    All byte counts are exact integers; ``kv_cache`` is None under sequence parallelism (training layout).

    Shapes:
        tp: x, y (b, S, d) per rank; sp: x, y (b, ceil(S / P), d) per rank; both: attention on (b, h_r, S, d_h)

    Example:
        >>> from headwise import AttentionConfig
        >>> c = AttentionConfig(d_model=4096, n_heads=32, n_kv_heads=8, bias=False)
        >>> r = parallel_costs(c, 32768, 8, dtype="bf16")
        >>> r["tp"]["sent_forward"] == 2 * 7 * 32768 * 4096 * 2 // 8, r["sp"]["input_output"] * 8 == r["tp"]["input_output"]
        (True, True)
        >>> parallel_costs(c, 1024, 64)["sp"]["error"][:52]
        'cannot run sequence parallelism over sp=64 ranks: th'
    """
    check_config(config)
    s = check_positive("seq_len", seq_len)
    b = check_positive("batch", batch)
    p = check_positive("ranks", ranks)
    _, item = dtype_info(dtype)
    held = s if sliding_window is None else min(s, check_positive("sliding_window", sliding_window))
    out: dict[str, Any] = {"ranks": p, "seq_len": s, "batch": b, "itemsize": item, "kv_positions": held}
    for name, fn in (("tp", _tp), ("sp", _sp)):
        try:
            out[name] = fn(config, b, s, p, item, probability_itemsize(dtype), lse_itemsize(dtype), held)
        except ValueError as err:
            out[name] = {"error": str(err)}
    return out
