"""A layer's projections as plain per-head tensors, and the three surgeries on them: take heads, pool K/V
groups, repeat K/V heads.

Everything here is tensor math on a :class:`HeadWeights` (no module is touched); :mod:`.layers` reads one
from a layer and writes one back. Weights are in ``nn.Linear`` order ``(out, in)``; head ``i`` owns rows
``i * d_h .. (i + 1) * d_h`` of W_Q and columns of W_O, K/V head ``j`` rows of W_K / W_V.

Shapes:
    h: query heads, h_kv: key/value heads, d: model width, d_h: head width, g: query heads per K/V head.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

__all__ = ["HeadWeights", "take_heads", "pool_groups", "expand_kv", "empty_like", "zeros_like", "as_projections"]


@dataclass(frozen=True)
class HeadWeights:
    """Q, K, V, O weights ``(out, in)`` and biases (or None) of one layer, with its head counts.

    Shapes:
        q_w (h * d_h, d); k_w, v_w (h_kv * d_h, kdim / vdim); o_w (d, h * d_h); biases (out,)
    """

    q_w: torch.Tensor
    q_b: torch.Tensor | None
    k_w: torch.Tensor
    k_b: torch.Tensor | None
    v_w: torch.Tensor
    v_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    n_heads: int
    n_kv_heads: int
    d_head: int
    heads_from: tuple[int, ...] | None = None  # the layer's current index of each query head (None: 0 .. h - 1)
    placeholder: bool = False  # every head removed: the one zero head left in their place

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads


def _rows(t: torch.Tensor | None, blocks: Sequence[int], d_h: int) -> torch.Tensor | None:
    """Row blocks ``blocks`` (each d_h rows) of ``t``, concatenated in that order."""
    if t is None:
        return None
    idx = torch.tensor([b * d_h + r for b in blocks for r in range(d_h)], dtype=torch.long, device=t.device)
    return t.index_select(0, idx)


def _cols(t: torch.Tensor, blocks: Sequence[int], d_h: int) -> torch.Tensor:
    idx = torch.tensor([b * d_h + r for b in blocks for r in range(d_h)], dtype=torch.long, device=t.device)
    return t.index_select(1, idx)


def _kv(hw: HeadWeights, mapping: Sequence[Sequence[int]]) -> tuple:
    """New K/V heads, each the mean of the old K/V heads listed (a list of one is a copy)."""
    d_h, out = hw.d_head, []
    for w in (hw.k_w, hw.k_b, hw.v_w, hw.v_b):
        if w is None:
            out.append(None)
            continue
        heads = w.reshape(hw.n_kv_heads, d_h, *w.shape[1:])  # (h_kv, d_h[, in])
        new = [heads[list(src)].mean(0) if len(set(src)) > 1 else heads[src[0]] for src in mapping]  # a copy stays exact
        out.append(torch.stack(new).reshape(len(mapping) * d_h, *w.shape[1:]))
    return tuple(out)


def take_heads(hw: HeadWeights, keep: Sequence[int], kv_of: Sequence[Sequence[int]], n_kv: int) -> HeadWeights:
    """The layer restricted to query heads ``keep`` (in order), with new K/V heads ``kv_of`` (each the mean
    of the old K/V heads it lists; query head ``keep[i]`` reads new K/V head ``i // (len(keep) // n_kv)``).

    Shapes:
        -> q_w (len(keep) * d_h, d), k_w (n_kv * d_h, kdim), o_w (d, len(keep) * d_h)
    """
    d_h = hw.d_head
    k_w, k_b, v_w, v_b = _kv(hw, kv_of)
    src = hw.heads_from or tuple(range(hw.n_heads))
    return replace(hw, q_w=_rows(hw.q_w, keep, d_h), q_b=_rows(hw.q_b, keep, d_h), k_w=k_w, k_b=k_b, v_w=v_w,
                   v_b=v_b, o_w=_cols(hw.o_w, keep, d_h), n_heads=len(keep), n_kv_heads=n_kv,
                   heads_from=tuple(src[i] for i in keep))


def pool_groups(hw: HeadWeights, groups: Sequence[Sequence[int]]) -> HeadWeights:
    """GQA by mean-pooling (Ainslie et al., 2023): query heads regrouped as ``groups`` (equal sizes; the heads
    of a group become consecutive), each group's K/V the mean of the K/V heads its members read.

    Shapes:
        -> q_w (h * d_h, d) reordered, k_w / v_w (len(groups) * d_h, kdim / vdim), o_w (d, h * d_h) reordered
    """
    order = [i for g in groups for i in g]
    g_old = hw.group_size
    kv_of = [[i // g_old for i in g] for g in groups]  # repeats weight a K/V head by its members
    return take_heads(hw, order, kv_of, len(groups))


def expand_kv(hw: HeadWeights) -> HeadWeights:
    """MHA again: every query head gets its own copy of the K/V head it reads (exact).

    Shapes:
        -> k_w / v_w (h * d_h, kdim / vdim)
    """
    g = hw.group_size
    return take_heads(hw, list(range(hw.n_heads)), [[i // g] for i in range(hw.n_heads)], hw.n_heads)


def empty_like(hw: HeadWeights) -> HeadWeights:
    """Every head removed: one placeholder head whose Q, K, V and W_O slices are zero, so the layer's output
    is exactly W_O's bias (headwise and Hugging Face modules need at least one head).

    Shapes:
        -> q_w (d_h, d), k_w / v_w (d_h, kdim / vdim), o_w (d, d_h), all zero
    """
    one = take_heads(hw, [0], [[0]], 1)
    zero = {name: None if t is None else torch.zeros_like(t)
            for name, t in (("q_w", one.q_w), ("q_b", one.q_b), ("k_w", one.k_w), ("k_b", one.k_b),
                            ("v_w", one.v_w), ("v_b", one.v_b), ("o_w", one.o_w))}
    return replace(one, placeholder=True, **zero)


def zeros_like(hw: HeadWeights, n_heads: int, n_kv_heads: int) -> HeadWeights:
    """Zero weights of ``n_heads`` / ``n_kv_heads`` heads with ``hw``'s widths, biases, device and dtype (a module
    resized before its weights are loaded).

    Shapes:
        -> q_w (n_heads * d_h, d), k_w / v_w (n_kv_heads * d_h, kdim / vdim), o_w (d, n_heads * d_h)
    """
    d_h = hw.d_head

    def z(t: torch.Tensor | None, *shape: int) -> torch.Tensor | None:
        return None if t is None else torch.zeros(*shape, device=t.device, dtype=t.dtype)

    return HeadWeights(z(hw.q_w, n_heads * d_h, hw.q_w.shape[1]), z(hw.q_b, n_heads * d_h),
                       z(hw.k_w, n_kv_heads * d_h, hw.k_w.shape[1]), z(hw.k_b, n_kv_heads * d_h),
                       z(hw.v_w, n_kv_heads * d_h, hw.v_w.shape[1]), z(hw.v_b, n_kv_heads * d_h),
                       z(hw.o_w, hw.o_w.shape[0], n_heads * d_h), z(hw.o_b, hw.o_w.shape[0]), n_heads, n_kv_heads, d_h)


def as_projections(hw: HeadWeights) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """``{q_proj, k_proj, v_proj, out_proj: (weight (out, in), bias)}``: what a view's ``write_heads`` takes."""
    return {"q_proj": (hw.q_w, hw.q_b), "k_proj": (hw.k_w, hw.k_b), "v_proj": (hw.v_w, hw.v_b),
            "out_proj": (hw.o_w, hw.o_b)}
