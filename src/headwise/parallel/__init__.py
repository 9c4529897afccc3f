"""Tensor and sequence parallelism by whole heads on ``torch.distributed`` (gloo on CPU, NCCL on GPU: one code path).

* :mod:`headwise.parallel.plan`: the head-partition arithmetic (:func:`plan_heads`, :class:`HeadPartition`,
  :class:`TensorParallelPlan`, :func:`valid_world_sizes`), pure Python, no process group needed.
* :mod:`headwise.parallel.tensor_parallel`: :func:`tensor_parallel` turns a :class:`~headwise.MultiHeadAttention`
  into this rank's :class:`TensorParallelAttention` (column-parallel Q/K/V, row-parallel W_O, one all-reduce).
* :mod:`headwise.parallel.sequence_plan` and :mod:`headwise.parallel.sequence_parallel`: sequence parallelism by
  heads (:func:`sequence_parallel`, DeepSpeed-Ulysses style: all-to-alls swap sequence sharding for heads), also
  on a 2-D ("sp", "tp") mesh with tensor parallelism; :func:`plan_sequence_parallel` is its pure arithmetic.

See ``docs/parallel.md`` and ``python -m torch.distributed.run --nproc-per-node 2 -m examples.tensor_parallel``.

Example:
    >>> from headwise.parallel import plan_heads
    >>> plan_heads(n_heads=8, n_kv_heads=1, world_size=2).partition(1).kv_heads   # MQA: K/V head replicated
    (0,)
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .plan import HeadPartition, TensorParallelPlan, plan_heads, valid_world_sizes
    from .sequence_parallel import CollectiveTimeoutError, SequenceParallelAttention, sequence_parallel
    from .sequence_plan import SequenceParallelPlan, SequenceRank, plan_sequence_parallel, valid_sequence_layouts
    from .tensor_parallel import HeadNotLocalError, TensorParallelAttention, tensor_parallel

# name -> submodule. The plans are pure arithmetic: importing them (e.g. for ``headwise explain``) must not
# import torch, so the layers load on first use.
_WHERE = {
    "HeadPartition": "plan", "TensorParallelPlan": "plan", "plan_heads": "plan", "valid_world_sizes": "plan",
    "SequenceParallelPlan": "sequence_plan", "SequenceRank": "sequence_plan",
    "plan_sequence_parallel": "sequence_plan", "valid_sequence_layouts": "sequence_plan",
    "CollectiveTimeoutError": "sequence_parallel", "SequenceParallelAttention": "sequence_parallel",
    "sequence_parallel": "sequence_parallel",
    "HeadNotLocalError": "tensor_parallel", "TensorParallelAttention": "tensor_parallel",
    "tensor_parallel": "tensor_parallel",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        module = importlib.import_module(f".{_WHERE[name]}", __name__)
        return globals()[name] if name in globals() else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """This package's module object. Importing a submodule sets the package attribute of its name to it;
    ``tensor_parallel`` and ``sequence_parallel`` name both a submodule and its function, and the function
    must win (as it would with eager imports), whoever imports the submodule first."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name == _WHERE.get(name):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


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
