"""Tensor parallelism's collectives as autograd functions, so that gradients come out exact.

Every rank holds the same input and computes the same loss from the same (replicated) output, so the
all-reduce after W_O has an identity backward, the input passes an identity whose backward sums the gradient
over the group, and replicated K/V weights pass an identity whose backward sums over their replicas
(:mod:`headwise.parallel.tensor`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CopyToHeads", "ReduceFromHeads", "SumOverReplicas"]


class CopyToHeads(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient: each rank's heads see the same input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class ReduceFromHeads(torch.autograd.Function):
    """All-reduce (sum) of the per-rank partial outputs; backward is the identity (the loss is replicated)."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any) -> torch.Tensor:
        out = partial.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class SumOverReplicas(torch.autograd.Function):
    """Identity on replicated K/V parameters; backward sums their gradients over the ranks holding the same
    K/V head.

    One all-reduce over the whole group of an ``(h_kv, numel)`` buffer in which each rank fills the row of
    its K/V head: rows of other K/V heads are zero on this rank, so the sum of a row is exactly the sum over
    that head's replicas, without creating a sub-group per K/V head.
    """

    @staticmethod
    def forward(ctx: Any, group: Any, n_slots: int, slot: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.n_slots, ctx.slot = group, n_slots, slot
        ctx.shapes = [t.shape for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        flat = torch.cat([g.reshape(-1) for g in grads])
        buf = flat.new_zeros(ctx.n_slots, flat.numel())
        buf[ctx.slot] = flat
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=ctx.group)
        out, start = [], 0
        for shape in ctx.shapes:
            n = shape.numel()
            out.append(buf[ctx.slot, start:start + n].view(shape))
            start += n
        return (None, None, None, *out)
