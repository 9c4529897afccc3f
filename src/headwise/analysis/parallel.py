"""Per-rank memory and communication of one self-attention layer split over P ranks: tensor parallelism (heads
split, sequence replicated) versus sequence parallelism (sequence split, heads swapped in by all-to-alls).

Closed forms, no torch; the head split comes from :mod:`headwise.parallel.plan` and
:mod:`headwise.parallel.sequence_plan` (the arithmetic the layers run). Per rank and per layer:

* tensor parallel (:func:`headwise.parallel.tensor_parallel`): weights of ``h / P`` query heads and their
  K/V heads; the full ``(b, S, d)`` input and output on every rank; one all-reduce of ``(b, S, d)`` forward and
  one backward (a ring all-reduce sends ``2 (P - 1) / P`` of its buffer); replicated K/V heads add one
  all-reduce of their weight gradients per step.
* sequence parallel (:func:`headwise.parallel.sequence_parallel`): all weights (replicated); a ``(b, S/P, d)``
  slice in and out; the attention step holds the whole (padded) sequence for ``ceil(h / P)`` heads (and for
  as many K/V heads where a rank repeats its K/V heads per query head); the all-to-alls send what
  :meth:`~headwise.parallel.sequence_plan.SequenceParallelPlan.all_to_all_bytes` says (the backward sends
  back what a rank received: the same amount where every rank attends with as many heads); the weight
  gradients are all-reduced once per step. Bytes sent are the largest over ranks, forward and backward each.

Shapes:
    b: batch, S: sequence, P: ranks, h / h_kv: query / K/V heads, h_r / kv_r: those one rank attends with,
    d: d_model, d_h: d_head; s = ceil(S / P): a padded slice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config import AttentionConfig
from ..parallel.plan import plan_heads
from ..parallel.sequence_plan import plan_sequence_parallel
from .flops import check_positive
from .memory import dtype_info, probability_itemsize
from .params import check_config, param_count

if TYPE_CHECKING:
    import torch

__all__ = ["parallel_costs", "ring_all_reduce_bytes"]

_LSE_BYTES = 4  # the fused kernel's float32 log-sum-exp per (b, head, query)


def ring_all_reduce_bytes(nbytes: int, ranks: int) -> int:
    """Bytes one rank sends in a ring all-reduce of an ``nbytes`` buffer: ``2 (P - 1) / P * nbytes``.

    Example:
        >>> ring_all_reduce_bytes(1000, 4), ring_all_reduce_bytes(1000, 1)
        (1500, 0)
    """
    return 2 * (ranks - 1) * nbytes // ranks


def _tp(c: AttentionConfig, b: int, s: int, p: int, item: int, p_item: int, held: int) -> dict[str, Any]:
    part = plan_heads(c.n_heads, c.n_kv_heads, p)
    h_r, kv_r, d_h = part.n_local_heads, part.n_local_kv_heads, c.d_head
    q = c.d_model * h_r * d_h + (h_r * d_h if c.bias else 0)
    kv = (c.kdim + c.vdim) * kv_r * d_h + (2 * kv_r * d_h if c.bias else 0)
    out = h_r * d_h * c.d_model + (c.d_model if c.out_bias else 0)
    kv_grads = (c.kdim + c.vdim + (2 if c.bias else 0)) * c.n_kv_heads * d_h * item if part.kv_replicated else 0
    io = b * s * c.d_model * item
    return {
        "heads": h_r, "kv_heads": kv_r, "weights": (q + kv + out) * item, "input_output": 2 * io,
        "qkv_context": b * s * (2 * h_r + 2 * kv_r) * d_h * item,
        "probabilities_eager": b * h_r * s * s * p_item, "lse_fused": b * h_r * s * _LSE_BYTES,
        "kv_cache": 2 * b * held * kv_r * d_h * item,  # the positions the cache holds: a window's at most
        "sent_forward": ring_all_reduce_bytes(io, p), "sent_backward": ring_all_reduce_bytes(io, p),
        "weight_grad_all_reduce": ring_all_reduce_bytes(kv_grads, p),
        "plan": part.describe().split("\n")[0],
    }


def _sp(c: AttentionConfig, b: int, s: int, p: int, item: int, p_item: int, held: int) -> dict[str, Any]:
    plan = plan_sequence_parallel(c.n_heads, c.n_kv_heads, sp=p)
    s_loc = -(-s // p)  # ceil: uneven slices are padded to the longest for the all-to-alls
    h_r = max(len(r.q_heads) for r in plan.ranks)
    kv_r = max(len(r.kv_heads) for r in plan.ranks)
    # A rank whose query heads do not read their K/V heads in the plain GQA pattern repeats K and V to one
    # head per query head before attending: it then holds len(q_heads) of each.
    attended = max(2 * len(r.q_heads) + 2 * (len(r.kv_heads) if r.grouped else len(r.q_heads))
                   for r in plan.ranks)
    # The largest over ranks, each way on its own: with uneven head counts the rank that sends most in the
    # forward is not the one that sends most in the backward (which returns what a rank received).
    sent = [plan.all_to_all_bytes(batch=b, s_q=s_loc, d_head=c.d_head, itemsize=item, sp_rank=r) for r in range(p)]
    weights = param_count(c).total * item
    return {
        "heads": h_r, "kv_heads": kv_r, "weights": weights, "input_output": 2 * b * s_loc * c.d_model * item,
        "qkv_context": b * s_loc * p * attended * c.d_head * item,
        "probabilities_eager": b * h_r * s * s * p_item, "lse_fused": b * h_r * s * _LSE_BYTES,
        "kv_cache": None,
        "sent_forward": max(n["forward"] for n in sent), "sent_backward": max(n["backward"] for n in sent),
        "weight_grad_all_reduce": ring_all_reduce_bytes(weights, p),
        "plan": plan.describe().split("\n")[0],
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
            out[name] = fn(config, b, s, p, item, probability_itemsize(dtype), held)
        except ValueError as err:
            out[name] = {"error": str(err)}
    return out
