"""Where surgery reads and writes a layer: a bare :class:`~headwise.MultiHeadAttention`, the layers inside a
module, or the attention modules of a model patched by :func:`headwise.interop.patch`.

* A bare layer is never changed: surgery returns a new, smaller copy (same class, rotary, backend, norms).
* Inside a plain module, each changed layer is replaced by its new copy under the same name.
* In a patched Hugging Face model the host's own modules are resized in place through each view's surgery
  seam (:mod:`.hosts`: new ``nn.Linear`` / ``Conv1D`` under the same names, the head-count attributes the
  forward reads, the config's head counts where they then rebuild the model), then the model is re-patched so
  every ``.attn`` view describes the new shapes; ``unpatch`` gives a plain HF model computing the same.

Shapes:
    h: query heads, h_kv: key/value heads, d: model width, d_h: head width.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..attention import MultiHeadAttention
from ..tracing import find_layers
from . import hosts, origin
from .weights import HeadWeights

__all__ = ["Target", "read", "new_layer"]


def read(layer: MultiHeadAttention) -> HeadWeights:
    """The layer's current weights (detached; views, no copy) as :class:`HeadWeights`."""
    projs = [getattr(layer, n) for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
    for name, p in zip(("q_proj", "k_proj", "v_proj", "out_proj"), projs):
        if isinstance(getattr(p, "base_layer", None), nn.Module):  # a value to refuse, as every family's seam does
            raise ValueError(f"surgery: {name} of this layer is wrapped by an adapter ({type(p).__name__} around "
                             f"{type(p.base_layer).__name__}, PEFT): merge_and_unload() first, so that the resized "
                             "projections keep what the adapter adds")
        if type(p) is not nn.Linear and type(p).__name__ != "ProjectionView":
            raise TypeError(f"surgery: {name} of this layer is a {type(p).__name__} (an adapter wrapper?); "
                            "merge or remove it first: surgery needs plain nn.Linear / Conv1D projections")

    def det(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach()

    q, k, v, o = projs
    c = layer.config
    return HeadWeights(det(q.weight), det(q.bias), det(k.weight), det(k.bias), det(v.weight), det(v.bias),
                       det(o.weight), det(o.bias), c.n_heads, c.n_kv_heads, c.d_head)


def _linear(w: torch.Tensor, b: torch.Tensor | None, like: nn.Module) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    lin.weight = nn.Parameter(w.clone(), requires_grad=like.weight.requires_grad)
    if b is not None:
        lin.bias = nn.Parameter(b.clone(), requires_grad=like.weight.requires_grad)
    return lin.train(like.training)


def new_layer(layer: MultiHeadAttention, hw: HeadWeights) -> MultiHeadAttention:
    """A copy of the bare ``layer`` (its class, rotary, norms, backend) holding ``hw`` in new projections."""
    new = copy.deepcopy(layer)
    cfg = layer.config.replace(n_heads=hw.n_heads, n_kv_heads=hw.n_kv_heads, d_head=hw.d_head, scale=layer.config.scale)
    new.q_proj, new.k_proj, new.v_proj, new.out_proj = (
        _linear(wt, bt, old) for wt, bt, old in ((hw.q_w, hw.q_b, layer.q_proj), (hw.k_w, hw.k_b, layer.k_proj),
                                                 (hw.v_w, hw.v_b, layer.v_proj), (hw.o_w, hw.o_b, layer.out_proj)))
    new.config = cfg
    return new


# -- one surgery over a layer or a model ---------------------------------------------------------------------
class Target:
    """The layers of ``target`` that surgery addresses, by position (as :func:`headwise.trace` numbers them)
    or module name, and the one place that applies new weights to them."""

    def __init__(self, target: Any, what: str) -> None:
        if isinstance(target, MultiHeadAttention) and hosts.is_view(target):
            raise TypeError(f"{what}: this layer is the view of a patched Hugging Face module; pass the patched "
                            "model (surgery resizes the module's own weights)")
        self.target, self.what = target, what
        try:
            self.layers = find_layers(target)
        except TypeError as e:
            raise TypeError(f"{what}: expected a MultiHeadAttention, a module containing them or a model patched "
                            f"by headwise.interop.patch; got {type(target).__name__} ({e})") from None
        self.hf = any(hosts.is_view(layer) for _, layer in self.layers)
        sharded = [n or type(m).__name__ for n, m in self.layers if type(m).__name__ == "TensorParallelAttention"]
        if sharded:
            raise TypeError(f"{what}: {sharded} already hold only this rank's heads (tensor_parallel); change the "
                            "whole layer, then shard it again")

    def index(self, ref: Any) -> int:
        names = [n for n, _ in self.layers]
        n = len(self.layers)
        if isinstance(ref, str):
            if ref not in names:
                raise ValueError(f"{self.what}: no layer is named {ref!r}; expected one of {names}")
            return names.index(ref)
        if isinstance(ref, bool) or not isinstance(ref, int):
            raise TypeError(f"{self.what}: a layer is given by position (int) or module name (str), got "
                            f"{type(ref).__name__}")
        if not -n <= ref < n:
            raise ValueError(f"{self.what}: layer position must be in [-{n}, {n}) for these {n} layers, got {ref}")
        return ref % n

    def select(self, which: Any) -> list[int]:
        """Layer positions: None (every layer), one ref, or a list of refs."""
        if which is None:
            return list(range(len(self.layers)))
        refs = list(which) if isinstance(which, (list, tuple, range)) else [which]
        out = [self.index(r) for r in refs]
        if len(set(out)) != len(out):
            raise ValueError(f"{self.what}: a layer is named twice in {refs!r}")
        return out

    def apply(self, new: Mapping[int, HeadWeights]) -> Any:
        """Write every ``new[i]`` into layer ``i``; returns the bare layer's copy or the (changed) model."""
        if not new:
            return self.target
        kept = {i: origin.compose(self.layers[i][1], hw) for i, hw in new.items()}  # before anything changes
        if isinstance(self.target, MultiHeadAttention):
            if 0 not in new:
                return self.target
            copy_ = new_layer(self.target, new[0])
            origin.record(copy_, kept[0])
            return copy_
        if self.hf:
            holders = {i: origin.holder(self.layers[i][1]) for i in new}
            model = hosts.apply(self.target, self.layers, new, self.what)
            for i, module in holders.items():
                origin.record(module, kept[i])
            return model
        for i, hw in new.items():
            name, layer = self.layers[i]
            parent, _, child = name.rpartition(".")
            replacement = new_layer(layer, hw)
            origin.record(replacement, kept[i])
            setattr(self.target.get_submodule(parent), child, replacement)
        return self.target


def check_all(items: Mapping[int, Any], check: Callable[[int, Any], HeadWeights]) -> dict[int, HeadWeights]:
    """Every layer's new weights, computed (and so validated) before anything is written."""
    return {i: check(i, v) for i, v in items.items()}
