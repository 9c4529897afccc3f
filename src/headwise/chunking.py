"""Long forwards without autograd, in query chunks: the memory of K, V and the output, not of Q and context too.

Every query row of attention is independent of the others (each head's softmax runs along the keys), so the
queries can be processed a chunk of positions at a time: project the chunk's queries, attend over the keys
they may read, apply W_O, write the chunk's rows of the output. Keys and values are projected once and read
by every chunk. An unchunked layer holds Q, K, V and the context together (4 x s x d floats); chunked, the
forward holds K, V and the output plus one chunk's temporaries. When this runs is the plan's decision
(:mod:`headwise.plan`, rule 7); this module only executes it, on tensors and callables.

Causal chunks read keys only up to their last query (bottom-right aligned, as everywhere in headwise), so
no chunk touches keys none of its queries may read. A chunk's keys are a prefix every query reads in full
and a square diagonal block that is causal in the kernel's own (top-left = bottom-right when square) sense.
With ``plan.lse_chunks`` the two run as separate flash-kernel calls merged by their log-sum-exp, exactly the
kernel's work for one causal pass (PyTorch's CPU flash op returns the log-sum-exp; the public SDPA does not).
Otherwise a chunk attends with an explicit bottom-right mask, which computes the masked half of each
diagonal block too: about ``chunk / s`` more attention work.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width (d_model), d_h: head width (d_head), c: positions per chunk.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .functional import attend
from .plan import Plan
from .rotary import apply_rotary

__all__ = ["attend_in_chunks", "forward_in_chunks"]


def attend_in_chunks(
    plan: Plan, queries: Callable[[int, int], torch.Tensor], k: torch.Tensor, v: torch.Tensor,
    mask: torch.Tensor | None, write: Callable[[int, int, torch.Tensor], None],
) -> None:
    """Run ``plan`` (which has a ``chunk``) one query chunk at a time.

    Args:
        plan: a plan with ``plan.chunk`` positions per chunk.
        queries: ``queries(i0, i1)`` returns the split (and rotated) queries of positions ``[i0, i1)``.
        k, v: every key and value, split into heads.
        mask: a validated 4-D mask or None.
        write: ``write(i0, i1, z)`` consumes the chunk's context (e.g. applies W_O into its output rows).

    Shapes:
        queries(i0, i1): (b, h, c, d_h); k, v: (b, h_kv, s_kv, d_h); mask: broadcastable to (b, h, s_q, s_kv)
        z given to write: (b, h, c, d_h)
    """
    s_q, s_kv, chunk = plan.shape[2], plan.shape[3], plan.chunk
    for i0 in range(0, s_q, chunk):
        i1 = min(i0 + chunk, s_q)
        q = queries(i0, i1)  # (b, h, c, d_h)
        # Bottom-right causal: query i reads keys j <= i + s_kv - s_q, so this chunk needs keys up to `end`.
        end = max(0, min(s_kv, i1 + s_kv - s_q)) if plan.causal else s_kv
        if plan.lse_chunks and end >= i1 - i0:
            z = _causal_chunk_by_lse(q, k, v, end - (i1 - i0), end, plan.scale)  # (b, h, c, d_h)
        else:
            rows = None
            if mask is not None:
                rows = mask if mask.shape[-2] == 1 else mask[..., i0:i1, :]
                rows = rows if mask.shape[-1] == 1 else rows[..., :end]
            z, _ = attend(plan.for_chunk(i1 - i0, end), q, k[:, :, :end], v[:, :, :end], rows)
        del q
        write(i0, i1, z)


def forward_in_chunks(layer: Any, plan: Plan, x: torch.Tensor, key: torch.Tensor | None,
                      value: torch.Tensor | None, mask: torch.Tensor | None,
                      positions: torch.Tensor | None) -> torch.Tensor:
    """A layer's forward on checked inputs, its queries in ``plan``'s chunks: keys and values projected once,
    then per chunk the queries projected (and rotated), attended and projected out into the output's rows.

    Args:
        layer: the ``MultiHeadAttention`` (its ``project_q``, ``project_kv``, ``project_out`` and ``rotary``).
        plan: the call's plan (with a ``chunk``).
        x: the queries' inputs (b, s_q, d); key, value: separate key/value inputs or None (self-attention).
        mask: the checked 4-D mask or None; positions: rotary positions (rotary layers only).

    Shapes:
        x: (b, s_q, d) -> (b, s_q, d)
    """
    k, v = layer.project_kv(x) if key is None else layer.project_kv(key, value)  # (b, h_kv, s_kv, d_h)
    cos = sin = None
    if layer.rotary is not None:  # self-attention only, so s_kv == s_q
        cos, sin = (t.to(x.dtype) for t in layer.rotary(positions, x.dtype))  # (b or 1, 1, s, r)
        k = apply_rotary(k, cos, sin)
    y = x.new_empty(x.shape[0], x.shape[1], layer.config.d_model)

    def queries(i0: int, i1: int) -> torch.Tensor:
        q = layer.project_q(x[:, i0:i1])  # (b, h, c, d_h)
        return q if cos is None else apply_rotary(q, cos[:, :, i0:i1], sin[:, :, i0:i1])

    def write(i0: int, i1: int, z: torch.Tensor) -> None:
        y[:, i0:i1] = layer.project_out(z)  # (b, c, d)

    attend_in_chunks(plan, queries, k, v, mask, write)
    return y


def _causal_chunk_by_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, end: int,
                         scale: float) -> torch.Tensor:
    """One causal chunk: every query reads keys ``[0, start)`` in full and the square block ``[start, end)``
    causally; the two softmaxes are merged through their log-sum-exps ``l``:
    ``out = sum_part exp(l_part - l) * out_part`` with ``l = logaddexp(l_a, l_b)``.

    Shapes:
        q: (b, h, c, d_h) with c = end - start; k, v: (b, h_kv, s_kv, d_h) -> (b, h, c, d_h)
    """
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out_b, lse_b = op(q, k[:, :, start:end], v[:, :, start:end], 0.0, True, scale=scale)  # (b, h, c, d_h), (b, h, c)
    if start == 0:
        return out_b
    out_a, lse_a = op(q, k[:, :, :start], v[:, :, :start], 0.0, False, scale=scale)
    lse = torch.logaddexp(lse_a, lse_b)  # (b, h, c)
    out_a = out_a.mul_(torch.exp(lse_a - lse).unsqueeze(-1))
    return out_a.add_(out_b.mul_(torch.exp(lse_b - lse).unsqueeze(-1)))  # (b, h, c, d_h)
