"""Tensor parallelism's collectives as autograd functions, so that gradients come out exact.

Every rank holds the same input and computes the same loss from the same (replicated) output, so the
all-reduce after W_O has an identity backward, the input passes an identity whose backward sums the gradient
over the group, and replicated K/V weights pass an identity whose backward sums over their replicas
(:mod:`headwise.parallel.tensor`). Sequence parallelism's all-to-all and its sum of the replicated weights'
gradients are here too (:mod:`headwise.parallel.sequence`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from .agreement import collective

__all__ = ["AllToAll", "CopyToHeads", "ReduceFromHeads", "SumOverReplicas", "copy_to_group"]


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


def copy_to_group(t: Any, group: Any, size: int) -> Any:
    """``t`` through :class:`CopyToHeads` (its gradient summed over ``group`` in backward) when it takes part
    in autograd over more than one rank; anything else (None, a tensor without gradient) as it is."""
    if isinstance(t, torch.Tensor) and size > 1 and torch.is_grad_enabled() and t.requires_grad:
        return CopyToHeads.apply(t, group)
    return t


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
    """Identity on replicated parameters; backward sums their gradients over the ranks holding the same
    replica (slot): the ranks holding the same K/V head under tensor parallelism (``n_slots`` = h_kv), every
    rank under sequence parallelism (``n_slots`` = 1, applied per call to the parameters that require grad
    then, so that ones unfrozen or replaced after the layer was built are summed too).

    With one slot each gradient is all-reduced as it is (one all-reduce per gradient, issued together), in a
    private copy: autograd may hand one gradient tensor to more than one input (a sum's backward does). With
    more, one all-reduce over the whole group of an ``(n_slots, numel)`` buffer in which each rank fills the
    row of its slot: rows of other slots are zero on this rank, so the sum of a row is exactly the sum over
    that slot's replicas, without creating a sub-group per slot (a sub-group would have to be created by
    every rank of the world, not inside one layer's backward). The gradients returned own exactly their
    storage: a view into the buffer would keep the whole buffer alive as ``.grad`` (autograd keeps the
    tensor it is given).
    """

    @staticmethod
    def forward(ctx: Any, group: Any, n_slots: int, slot: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.n_slots, ctx.slot = group, n_slots, slot
        ctx.shapes = [t.shape for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        what, size = "the gradient all-reduce of replicated weights", dist.get_world_size(ctx.group)
        if ctx.n_slots == 1:
            out = [g.clone(memory_format=torch.contiguous_format) for g in grads]

            def reduce_each() -> None:
                works = [dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group, async_op=True) for g in out]
                for work in works:
                    work.wait()

            collective(what, size, reduce_each)
            return (None, None, None, *out)
        sizes = [shape.numel() for shape in ctx.shapes]
        dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))  # a bf16 weight, an fp32 bias
        buf = grads[0].new_zeros(ctx.n_slots, sum(sizes), dtype=dtype)
        for part, g in zip(buf[ctx.slot].split(sizes), grads):
            part.copy_(g.reshape(-1))
        collective(what, size, lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=ctx.group))
        out = [part.view(shape).to(g.dtype, copy=True)
               for part, shape, g in zip(buf[ctx.slot].split(sizes), ctx.shapes, grads)]
        return (None, None, None, *out)


def _exchange(send: torch.Tensor, group: Any, size: int, send_splits: list[int], recv_splits: list[int],
              what: str) -> torch.Tensor:
    send = send.contiguous()
    out = send.new_empty((sum(recv_splits), *send.shape[1:]))
    collective(f"sequence_parallel: {what}", size,
               lambda: dist.all_to_all_single(out, send, recv_splits, send_splits, group=group))
    return out


class AllToAll(torch.autograd.Function):
    """all_to_all_single on dim 0 (block i of ``send``, ``send_splits[i]`` rows, goes to rank i); its backward
    is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, send: torch.Tensor, group: Any, size: int, send_splits: list[int],
                recv_splits: list[int], what: str) -> torch.Tensor:
        ctx.args = (group, size, send_splits, recv_splits, what)
        return _exchange(send, group, size, send_splits, recv_splits, what)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        group, size, send_splits, recv_splits, what = ctx.args
        return _exchange(grad, group, size, recv_splits, send_splits, f"backward of {what}"), *(None,) * 5
