"""Every rank of a tensor-parallel layer makes the same call, or every rank refuses it: what a rank of a
:class:`~headwise.parallel.tensor.TensorParallelAttention` sends in the one small all-gather before its forward's
all-reduce (:func:`~headwise.parallel.agreement.agree`).

The all-reduce after W_O pairs the ranks' calls by order and only by size, and a forward runs one all-reduce per
query chunk. So the ranks compare whatever decides the shapes they reduce and how many reductions they run: the
arguments' signatures, the flags, the cache's length and owner, grad and training mode, the trainable parameters
(replicated K/V heads sum their gradients over the replicas in backward), the chunking setting, and whether forward
hooks on ``q_proj`` / ``out_proj`` keep this rank's call in one pass where the plan would chunk it.

Shapes:
    x: (b, s_q, d) or (s_q, d); context: (b, s_kv, d); mask: broadcastable to (b, h, s_q, s_kv), h global
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..attention import MultiHeadAttention
from ..call_plan import plan_forward
from ..kv_cache import KVCache
from ..module_calls import has_forward_hooks
from ..validation import check_forward
from .agreement import agree, flag, signature

__all__ = ["OPTIONS", "agree_on_call"]

#: The keyword options of MultiHeadAttention.forward besides the inputs and the mask (causal, cache, ...).
OPTIONS = tuple(n for n, p in inspect.signature(MultiHeadAttention.forward).parameters.items()
                if p.kind is p.KEYWORD_ONLY and n not in ("key", "value", "mask"))


def agree_on_call(layer: Any, x: Any, context: Any, key: Any, value: Any, mask: Any, options: dict) -> None:
    """Every rank of ``layer``'s group makes the same call, or every rank raises the same error (one all-gather).

    With equal signatures the forward's own checks, which read only shapes, dtypes, devices and flags, pass or
    refuse on every rank alike; what they cannot see from here is checked first, locally.

    Args:
        layer: the ``TensorParallelAttention``; x, context, key, value, mask: as given to its forward;
            options: the forward's other keyword arguments.
    """
    error, unchunked = None, 0
    try:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"forward() got unexpected keyword arguments {unknown}; it takes {list(OPTIONS)}")
        layer.local_mask(mask)
        unchunked = _unchunked_by_hooks(layer, x, context, key, value, mask, options)
    except (ValueError, TypeError) as err:
        error = err
    w = layer.q_proj.weight
    cache, chunks = options.get("cache"), getattr(layer, "chunk_queries", True)
    same = {
        "inputs x": signature(x, w.device), "inputs context": signature(context, w.device),
        "inputs key": signature(key, w.device), "inputs value": signature(value, w.device),
        "masks": signature(mask, w.device), "positions": signature(options.get("positions"), w.device),
        "causal flags (0: False, 1: True, 2: not a bool)": flag(options.get("causal", False)),
        "return_weights flags (0: False, 1: True, 2: not a bool)": flag(options.get("return_weights", False)),
        "caches (0: none, 1: a KVCache, 2: not one; length; owner: 0 none, 1 this layer, 2 another)":
            _cache_state(layer, cache),
        "cache keys": signature(cache.keys if isinstance(cache, KVCache) else None, w.device),
        # Bit i: parameter i is trainable. Replicated K/V heads enter the backward's sum over replicas
        # only where they are, so every rank must freeze the same parameters or the sums would not pair.
        "layer states (grad mode, training, traced, trainable parameters as bits, chunk_queries)": (
            int(torch.is_grad_enabled()), int(layer.training), int(layer.tracer is not None),
            sum(1 << i for i, p in enumerate(layer.parameters()) if p.requires_grad),
            -1 if chunks is True else int(chunks)),
        # Query chunks run one all-reduce each: a rank whose hooks keep its call whole would pair its one
        # all-reduce with another rank's first chunk.
        "query chunks turned off by forward hooks on q_proj or out_proj (0: no, 1: yes)": (unchunked,),
    }
    agree(layer.group, layer.world_size, w.device, "tensor_parallel", error, same)


def _unchunked_by_hooks(layer: Any, x: Any, context: Any, key: Any, value: Any, mask: Any, options: dict) -> int:
    """1 if forward hooks on ``q_proj`` / ``out_proj`` keep this call in one pass where the layer's plan would
    run it in query chunks; only a rank with such hooks plans the call here."""
    if layer.tracer is not None or not (has_forward_hooks(layer.q_proj) or has_forward_hooks(layer.out_proj)):
        return 0  # a trace never chunks; without hooks the plan chunks as on every other rank
    w = layer.q_proj.weight
    causal, cache, weights = options.get("causal", False), options.get("cache"), options.get("return_weights", False)
    x, key, value, mask, _, _ = check_forward(layer.config, w.dtype, w.device, layer.rotary is not None, x,
                                              context, key, value, layer.local_mask(mask), causal, cache,
                                              options.get("positions"), weights)
    plan = plan_forward(layer, x, key, mask, causal, cache, weights, backend=layer.backend,
                        chunk_queries=layer.chunk_queries, value=value)
    return int(plan.hooked)


def _cache_state(layer: Any, cache: Any) -> tuple[int, int, int]:
    if not isinstance(cache, KVCache):
        return (0 if cache is None else 2, 0, 0)
    return (1, cache.length, 0 if cache.owner is None else 1 if cache.owner is layer else 2)
