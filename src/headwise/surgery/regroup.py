"""``to_gqa`` / ``to_mha``: regroup K/V heads (Ainslie et al., 2023, "GQA: Training Generalized Multi-Query
Transformer Models from Multi-Head Checkpoints"), and back.

``to_gqa(x, n_kv_heads)`` deals the query heads into ``n_kv_heads`` equal groups and gives each group one K/V
head: the mean of the K/V projections (weights and biases) its members read. Groups are consecutive heads
by default (the paper's recipe); ``groups="similarity"`` puts heads with similar K/V projections together
(:func:`similarity_groups`) and reorders the query heads (and W_O's columns) so each group is consecutive;
the layer's function does not depend on that order. The KV cache shrinks by ``h_kv / n_kv_heads``.
``to_mha`` gives every query head its own copy of the K/V head it reads: exact, so ``to_mha(to_gqa(x, g))``
computes what ``to_gqa(x, g)`` computes.

Shapes:
    h: query heads, h_kv: key/value heads, d_h: head width; groups: lists of query-head indices.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch

from ..attention import MultiHeadAttention
from .layers import Target, read
from .weights import HeadWeights, expand_kv, pool_groups

__all__ = ["to_gqa", "to_mha", "similarity_groups"]


def _kv_vectors(hw: HeadWeights) -> torch.Tensor:
    """Each query head's K and V projection (of the K/V head it reads), flattened. Shapes: -> (h, n)."""
    parts = []
    for w in (hw.k_w, hw.k_b, hw.v_w, hw.v_b):
        if w is not None:
            parts.append(w.reshape(hw.n_kv_heads, -1).double())  # (h_kv, d_h * in)
    per_kv = torch.cat(parts, dim=1)  # (h_kv, n)
    return per_kv.repeat_interleave(hw.group_size, dim=0)  # (h, n)


def similarity_groups(layer: MultiHeadAttention | HeadWeights, n_groups: int) -> list[list[int]]:
    """Query heads in ``n_groups`` equal groups of similar K/V projections (cosine similarity of the
    flattened W_K, W_V and biases): greedily, the lowest unassigned head takes the unassigned heads most
    similar to it. Deterministic. What ``to_gqa(..., groups="similarity")`` uses.

    Shapes:
        -> n_groups lists of h // n_groups head indices, each sorted

    Example:
        >>> import headwise
        >>> attn = headwise.MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2)
        >>> similarity_groups(attn, 2)   # heads that share a K/V head are the most similar
        [[0, 1], [2, 3]]
    """
    hw = read(layer) if isinstance(layer, MultiHeadAttention) else layer
    if not isinstance(hw, HeadWeights):
        raise TypeError(f"similarity_groups: expected a MultiHeadAttention, got {type(layer).__name__}")
    _check_n_kv(n_groups, hw.n_heads, "similarity_groups")
    vec = torch.nn.functional.normalize(_kv_vectors(hw), dim=1)
    sim = vec @ vec.T  # (h, h)
    size = hw.n_heads // n_groups
    left = list(range(hw.n_heads))
    groups = []
    while left:
        seed = left[0]
        others = sorted(left[1:], key=lambda j: (-float(sim[seed, j]), j))[:size - 1]
        group = sorted([seed, *others])
        groups.append(group)
        left = [j for j in left if j not in group]
    return groups


def _check_n_kv(n_kv_heads: Any, h: int, where: str) -> int:
    if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int):
        raise TypeError(f"{where}: n_kv_heads must be an int, got {type(n_kv_heads).__name__}")
    if n_kv_heads < 1 or h % n_kv_heads:
        ok = [k for k in range(1, h + 1) if h % k == 0]
        raise ValueError(f"{where}: n_kv_heads must divide n_heads={h}; valid: {ok}, got {n_kv_heads}")
    return n_kv_heads


def to_gqa(target: Any, n_kv_heads: int, *, groups: str | Sequence[Sequence[int]] = "consecutive",
           layers: Any = None) -> Any:
    """Mean-pool the K/V heads of every layer (or of ``layers``) into ``n_kv_heads`` groups.

    ``target`` is handled as in :func:`~headwise.surgery.prune_heads` (a bare layer gives a new copy; a module
    or a patched model changes in place). Hugging Face modules without K/V groups (no ``num_key_value_groups``:
    BERT, GPT-2, OPT, ...) refuse it with a ``ValueError``: regroup a standalone copy (``headwise.interop.from_hf``)
    instead.

    Args:
        target: a layer or a model.
        n_kv_heads: K/V heads per layer afterwards; must divide each layer's n_heads.
        groups: ``"consecutive"`` (heads ``i * g .. (i + 1) * g``), ``"similarity"`` (:func:`similarity_groups`)
            or, for one layer, explicit equal groups of query-head indices covering every head once.
        layers: which layers (positions or names; default all).

    Shapes:
        each layer: (d, h, h_kv, d_h) -> (d, h, n_kv_heads, d_h)

    Example:
        >>> import torch, headwise
        >>> from headwise.surgery import to_gqa, to_mha
        >>> attn = headwise.MultiHeadAttention(d_model=16, n_heads=4)
        >>> gqa = to_gqa(attn, 2)
        >>> gqa.n_kv_heads, tuple(gqa.k_proj.weight.shape)
        (2, (8, 16))
        >>> torch.testing.assert_close(gqa.k_proj.weight[:4], attn.k_proj.weight[:8].reshape(2, 4, 16).mean(0))
        >>> x = torch.randn(1, 3, 16)
        >>> torch.testing.assert_close(to_mha(gqa)(x), gqa(x))
    """
    tgt = Target(target, "to_gqa")
    chosen = tgt.select(layers)
    explicit = not isinstance(groups, str)
    if not explicit and groups not in ("consecutive", "similarity"):
        raise ValueError(f"to_gqa: groups must be 'consecutive', 'similarity' or a list of head groups, got {groups!r}")
    if explicit and len(chosen) != 1:
        raise ValueError(f"to_gqa: explicit groups describe one layer; pass layers=<one layer>, got {len(chosen)}")
    new = {}
    for i in chosen:
        hw = read(tgt.layers[i][1], tgt.layers[i][0])
        where = f"to_gqa, layer {i} ({tgt.layers[i][0] or 'the layer'})"
        n = _check_n_kv(n_kv_heads, hw.n_heads, where)
        if explicit:
            parts = _check_groups(groups, hw.n_heads, n, where)
        elif groups == "similarity":
            parts = similarity_groups(hw, n)
        else:
            size = hw.n_heads // n
            parts = [list(range(j * size, (j + 1) * size)) for j in range(n)]
        new[i] = pool_groups(hw, parts)
    return tgt.apply(new)


def _check_groups(groups: Any, h: int, n: int, where: str) -> list[list[int]]:
    try:
        parts = [list(g) for g in groups]
    except TypeError:
        raise TypeError(f"{where}: groups must be a list of lists of head indices, got {groups!r}") from None
    for g in parts:
        for j in g:
            if isinstance(j, bool) or not hasattr(type(j), "__index__"):  # an int (or numpy / torch integer)
                raise TypeError(f"{where}: group members must be int head indices, got {type(j).__name__} "
                                f"({j!r}) in {groups!r}")
    parts = [[operator.index(j) for j in g] for g in parts]
    flat = sorted(j for g in parts for j in g)
    if len(parts) != n or len({len(g) for g in parts}) != 1 or flat != list(range(h)):
        raise ValueError(f"{where}: expected {n} groups of {h // n} heads covering heads 0..{h - 1} once each, "
                         f"got {groups!r}")
    return parts


def to_mha(target: Any, *, layers: Any = None) -> Any:
    """One K/V head per query head again, each a copy of the K/V head it read (exact). A bare layer gives a
    new copy (also when it already has one K/V head per query head); a model changes in place.

    Args:
        target: a layer or a model (as :func:`to_gqa`).
        layers: which layers (default all).

    Shapes:
        each layer: (d, h, h_kv, d_h) -> (d, h, h, d_h)
    """
    tgt = Target(target, "to_mha")
    new = {}
    for i in tgt.select(layers):
        hw = read(tgt.layers[i][1], tgt.layers[i][0])
        if hw.n_kv_heads != hw.n_heads:
            new[i] = expand_kv(hw)
    if isinstance(target, MultiHeadAttention) and not new:  # already MHA: still the copy promised
        new = {0: read(target)}
    return tgt.apply(new)
