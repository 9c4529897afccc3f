"""Tensor and sequence parallelism by whole heads on ``torch.distributed`` (gloo on CPU, NCCL on GPU: one code path).

* :mod:`headwise.parallel.plan`: the head-partition arithmetic (:func:`plan_heads`, :class:`HeadPartition`,
  :class:`TensorParallelPlan`, :func:`valid_world_sizes`), pure Python, no process group needed.
* :mod:`headwise.parallel.tensor`: :func:`tensor_parallel` turns a :class:`~headwise.MultiHeadAttention`
  into this rank's :class:`TensorParallelAttention` (column-parallel Q/K/V, row-parallel W_O, one all-reduce);
  :mod:`headwise.parallel.source`: what a shard carries of the layer (per-head Q/K norms included) and the
  layers it refuses; :mod:`headwise.parallel.tensor_call`: what its ranks compare before each forward.
* :mod:`headwise.parallel.sequence_plan` and :mod:`headwise.parallel.sequence`: sequence parallelism by
  heads (:func:`sequence_parallel`, DeepSpeed-Ulysses style: all-to-alls swap sequence sharding for heads), also
  on a 2-D ("sp", "tp") mesh with tensor parallelism; :func:`plan_sequence_parallel` is its pure arithmetic.
* :mod:`headwise.parallel.autograd`: the collectives of tensor parallelism as autograd functions.
* :mod:`headwise.parallel.shard_state`: which heads a tensor-parallel shard holds, in its state dict.
* :mod:`headwise.parallel.agreement`: every rank makes the same call or every rank refuses it (one small
  all-gather before the real collectives).

See ``docs/parallel.md`` and ``python -m torch.distributed.run --nproc-per-node 2 -m examples.tensor_parallel``.

Example:
    >>> from headwise.parallel import plan_heads
    >>> plan_heads(n_heads=8, n_kv_heads=1, world_size=2).partition(1).kv_heads   # MQA: K/V head replicated
    (0,)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .agreement import CollectiveTimeoutError
    from .plan import HeadPartition, TensorParallelPlan, plan_heads, valid_world_sizes
    from .sequence import SequenceParallelAttention, sequence_parallel
    from .sequence_plan import SequenceParallelPlan, SequenceRank, plan_sequence_parallel, valid_sequence_layouts
    from .tensor import HeadNotLocalError, TensorParallelAttention, tensor_parallel

# name -> submodule. The plans are pure arithmetic: importing them (e.g. for ``headwise explain``) must not
# import torch, so the layers load on first use.
_WHERE = {
    "HeadPartition": "plan", "TensorParallelPlan": "plan", "plan_heads": "plan", "valid_world_sizes": "plan",
    "SequenceParallelPlan": "sequence_plan", "SequenceRank": "sequence_plan",
    "plan_sequence_parallel": "sequence_plan", "valid_sequence_layouts": "sequence_plan",
    "CollectiveTimeoutError": "agreement",
    "SequenceParallelAttention": "sequence", "sequence_parallel": "sequence",
    "HeadNotLocalError": "tensor", "TensorParallelAttention": "tensor", "tensor_parallel": "tensor",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "CollectiveTimeoutError",
    "HeadNotLocalError",
    "HeadPartition",
    "SequenceParallelAttention",
    "SequenceParallelPlan",
    "SequenceRank",
    "TensorParallelAttention",
    "TensorParallelPlan",
    "plan_heads",
    "plan_sequence_parallel",
    "sequence_parallel",
    "tensor_parallel",
    "valid_sequence_layouts",
    "valid_world_sizes",
]
