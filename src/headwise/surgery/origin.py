"""Which original head each surviving head is: the record every surgery keeps, on the module that holds the
weights, so that "head 1" of a pruned layer can still be called L0H2.

A layer never changed by surgery has no record (its heads are 0 .. h - 1). Each surgery composes the record
with the heads it keeps, in their new order: pruning heads 1 and 3 of (0, 1, 2, 3) leaves (0, 2); pruning the
new head 0 of that layer leaves (2,); ``to_gqa(..., groups="similarity")`` reorders it. A layer whose every
head was removed holds one placeholder head and records ``()``. The record lives on a bare
:class:`~headwise.MultiHeadAttention` itself (copies keep it) and, in a patched Hugging Face model, on the
patched module (the view's host), so it survives ``unpatch`` / ``patch``; :func:`headwise.surgery.save_pretrained`
writes it into the sidecar and :func:`headwise.surgery.load_pretrained` puts it back.

Shapes:
    per layer: a tuple of n_heads original indices (``()`` for the placeholder of an emptied layer)
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..head import ORIGINAL_HEADS
from ..tracing import find_layers
from . import hosts
from .weights import HeadWeights

__all__ = ["ATTRIBUTE", "original_heads", "of_layer", "record", "compose", "holder"]

ATTRIBUTE = ORIGINAL_HEADS


def holder(layer: Any) -> nn.Module:
    """The module that keeps ``layer``'s record: the patched module of a view, else the layer itself."""
    return layer.host if hosts.is_view(layer) else layer


def of_layer(layer: Any) -> tuple[int, ...]:
    """The original index of each head of ``layer`` now (``()``: every head was removed; a placeholder is left)."""
    saved = holder(layer).__dict__.get(ATTRIBUTE)
    return tuple(range(layer.n_heads)) if saved is None else tuple(saved)


def record(module: nn.Module, heads: tuple[int, ...] | None) -> None:
    """Keep ``heads`` as the original indices of ``module``'s heads (None: forget, 0 .. h - 1 again)."""
    if heads is None:
        module.__dict__.pop(ATTRIBUTE, None)
    else:
        module.__dict__[ATTRIBUTE] = tuple(int(i) for i in heads)


def compose(layer: Any, hw: HeadWeights) -> tuple[int, ...]:
    """The record of ``layer`` after it takes ``hw`` (whose ``heads_from`` are indices into its current heads)."""
    now = of_layer(layer)
    if hw.placeholder or not now:  # an emptied layer's placeholder is no original head, however it is regrouped
        return ()
    if hw.heads_from is None:
        return now
    return tuple(now[i] for i in hw.heads_from)


def original_heads(target: Any) -> list[tuple[int, ...]]:
    """Per layer (as :func:`headwise.trace` and :func:`headwise.interop.layers` number them), the original index
    of each of its heads now; ``()`` where every head was removed (the layer keeps a zero placeholder head).

    Shapes:
        -> one tuple of n_heads ints per layer

    Example:
        >>> import torch, headwise
        >>> from headwise.surgery import original_heads, prune_heads
        >>> model = torch.nn.Sequential(headwise.MultiHeadAttention(16, 4), headwise.MultiHeadAttention(16, 4))
        >>> _ = prune_heads(model, {0: [1, 3]})
        >>> _ = prune_heads(model, {0: [0]})       # the new head 0 is the original head 0
        >>> original_heads(model)
        [(2,), (0, 1, 2, 3)]
    """
    try:
        found = find_layers(target)
    except TypeError as exc:
        raise TypeError(f"original_heads: expected a MultiHeadAttention, a module containing them or a model "
                        f"patched by headwise.interop.patch; got {type(target).__name__} ({exc})") from None
    return [of_layer(layer) for _, layer in found]
