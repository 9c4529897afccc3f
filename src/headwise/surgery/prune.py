"""``prune_heads``: remove attention heads for good (Michel et al., 2019, "Are Sixteen Heads Really Better
than One?").

A removed head loses its W_Q rows and its W_O columns, so the layer computes exactly what the unpruned layer
computes with those heads' contexts zeroed. Under GQA/MQA a K/V head goes only with the last query head
that reads it. When the surviving groups end up of different sizes, the exact default splits each group
into sub-groups of their greatest common size (a K/V head is then stored once per sub-group); with
``regroup=True`` the surviving query heads are instead dealt, in order, into as many equal groups as K/V
heads survive, each group's K/V the mean of those its members read (an approximation, like :func:`to_gqa`).
Removing every head of a layer leaves one placeholder head whose Q, K, V and W_O slices are zero (headwise
and Hugging Face modules need a head), so that layer outputs exactly W_O's bias.

Shapes:
    h: query heads, h_kv: key/value heads, g: query heads per K/V head, d_h: head width.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Iterable, Mapping

import torch

from ..attention import MultiHeadAttention
from .layers import Target, read
from .weights import HeadWeights, empty_like, take_heads

__all__ = ["prune_heads"]


def _index(i: Any, where: str) -> int:
    """One head index: an int or an integer numpy / torch scalar (what ``argsort`` of a score gives)."""
    is_bool = isinstance(i, bool) or type(i).__name__ in ("bool_", "bool") or (
        isinstance(i, torch.Tensor) and i.dtype == torch.bool) or str(getattr(i, "dtype", "")) == "bool"
    if is_bool:
        raise TypeError(f"{where}: head indices must be ints, got a bool ({i!r}); for a boolean mask pass "
                        "its indices (mask.nonzero().flatten())")
    if isinstance(i, torch.Tensor) and i.dim() != 0:
        raise TypeError(f"{where}: head indices must be ints, got a tensor of shape {tuple(i.shape)}")
    try:
        return operator.index(i)
    except TypeError:
        raise TypeError(f"{where}: head indices must be ints, got {type(i).__name__} ({i!r}); integer numpy / "
                        "torch scalars and 1-d integer tensors / arrays are accepted") from None


def _heads(value: Any, h: int, where: str) -> list[int]:
    ndim = getattr(value, "ndim", None) if isinstance(getattr(value, "ndim", None), int) else None
    if ndim is not None and ndim > 1:  # iterating it would give rows, refused one by one with a vaguer message
        raise TypeError(f"{where}: heads are given as one index or a 1-d list of indices, got a {ndim}-d "
                        f"{type(value).__name__} of shape {tuple(value.shape)}")
    scalar = ndim == 0 or (ndim is None and hasattr(type(value), "__index__"))
    items = [value] if scalar else value
    if not isinstance(items, Iterable) or isinstance(items, (str, bytes)):
        raise TypeError(f"{where}: heads are given as a list of ints, got {type(value).__name__}")
    items = [_index(i, where) for i in items]
    for i in items:
        if not 0 <= i < h:
            raise ValueError(f"{where}: head indices must be in [0, {h}) (the layer has {h} heads), got {i}")
    if len(set(items)) != len(items):
        dup = sorted({i for i in items if items.count(i) > 1})
        raise ValueError(f"{where}: each head may be named once, got {dup} more than once in {items}")
    return items


def pruned(hw: HeadWeights, drop: list[int], *, regroup: bool = False, where: str = "prune_heads") -> HeadWeights:
    """``hw`` without query heads ``drop`` (the rules in the module docstring)."""
    keep = [i for i in range(hw.n_heads) if i not in set(drop)]
    if not keep:
        return empty_like(hw)
    g = hw.group_size
    counts: dict[int, int] = {}
    for i in keep:
        counts[i // g] = counts.get(i // g, 0) + 1
    sizes = set(counts.values())
    if len(sizes) == 1:
        return take_heads(hw, keep, [[j] for j in counts], len(counts))
    if regroup:
        m = len(counts)
        if len(keep) % m:
            raise ValueError(f"{where}: regroup=True deals the {len(keep)} remaining query heads into {m} equal "
                             f"groups (one per surviving K/V head), but {m} does not divide {len(keep)}; "
                             "remove a different number of heads, or leave regroup=False (exact)")
        size = len(keep) // m
        chunks = [keep[s:s + size] for s in range(0, len(keep), size)]
        return take_heads(hw, keep, [[i // g for i in c] for c in chunks], m)
    size = math.gcd(*counts.values())
    kv_of = [[j] for j, c in counts.items() for _ in range(c // size)]
    return take_heads(hw, keep, kv_of, len(kv_of))


def prune_heads(target: Any, heads: Mapping[Any, Any] | Iterable[int], *, regroup: bool = False) -> Any:
    """Remove query heads: ``{layer: [heads]}`` (layers by position, as :func:`headwise.trace` numbers them,
    or by module name); for a bare layer a plain list of heads also works.

    ``target`` is a :class:`~headwise.MultiHeadAttention` (a smaller copy is returned; the original is
    untouched), a module containing them (each changed layer is replaced in place) or a model patched by
    :func:`headwise.interop.patch` (its own modules are resized in place and it is re-patched). Everything is
    checked before anything changes. Head indices are the layer's current ones; the survivors keep their
    order and are renumbered from 0.

    Args:
        target: a layer or a model.
        heads: which heads to remove, per layer.
        regroup: under GQA, deal the remaining query heads into equal groups (mean K/V) instead of the exact
            sub-grouping when groups end up of different sizes.

    Shapes:
        each changed layer: (d, h, h_kv, d_h) -> (d, h - removed, h_kv', d_h)

    Example:
        >>> import torch, headwise
        >>> from headwise.surgery import prune_heads
        >>> attn = headwise.MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2)
        >>> small = prune_heads(attn, [0, 1])
        >>> small.n_heads, small.n_kv_heads
        (2, 1)
        >>> x = torch.randn(2, 5, 16)
        >>> with headwise.trace(attn, edit={(0, 0): "zero", (0, 1): "zero"}):
        ...     ablated = attn(x)
        >>> torch.testing.assert_close(small(x), ablated)
    """
    tgt = Target(target, "prune_heads")
    if isinstance(regroup, bool) is False:
        raise TypeError(f"prune_heads: regroup must be a bool, got {type(regroup).__name__}")
    if not isinstance(heads, Mapping):
        if len(tgt.layers) != 1:
            raise TypeError(f"prune_heads: pass {{layer: [heads]}} for a model with {len(tgt.layers)} layers, "
                            f"got {type(heads).__name__}")
        heads = {0: heads}
    plan: dict[int, list[int]] = {}
    for ref, value in heads.items():
        i = tgt.index(ref)
        if i in plan:
            raise ValueError(f"prune_heads: layer {i} ({tgt.layers[i][0]!r}) is named twice (as {ref!r})")
        layer = tgt.layers[i][1]
        plan[i] = _heads(value, layer.n_heads, f"prune_heads, layer {ref!r}")
    new = {i: pruned(read(tgt.layers[i][1], tgt.layers[i][0]), drop, regroup=regroup,
                     where=f"prune_heads, layer {i}") for i, drop in plan.items() if drop}
    if isinstance(target, MultiHeadAttention) and not new:  # nothing removed: still the copy promised
        new = {0: read(target)}
    return tgt.apply(new)
