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
from ..module_calls import adapter_base
from ..tracing import find_layers
from . import hosts, origin
from .weights import HeadWeights

__all__ = ["Target", "read", "new_layer", "take_hooks"]


def _wrapped(module: Any) -> nn.Module | None:
    """The layer a PEFT wrapper computes around: its ``base_layer`` (LoRA and the other tuners: a delta on top) or
    its ``original_module`` (``modules_to_save``: a trained copy per adapter beside it); None for a plain module."""
    base = adapter_base(module)
    if base is not None:
        return base
    original = getattr(module, "original_module", None)
    return original if isinstance(original, nn.Module) else None


def read(layer: MultiHeadAttention, name: str = "") -> HeadWeights:
    """The layer's current weights (detached; views, no copy) as :class:`HeadWeights`.

    Args:
        layer: a :class:`~headwise.MultiHeadAttention` or the view of a patched module.
        name: the layer's qualified name in the model surgery was given (a refusal names its projection by it).
    """
    projs = [getattr(layer, n) for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
    own = layer.source_names() if hosts.is_view(layer) else {}  # the host's name for each projection
    where = name or (layer.host_name if hosts.is_view(layer) else "")
    for proj, p in zip(("q_proj", "k_proj", "v_proj", "out_proj"), projs):
        base = _wrapped(p)
        if base is not None:  # a value to refuse, as every family's seam does
            qual = ".".join(x for x in (where, own.get(proj, proj)) if x)
            if adapter_base(p) is not None:
                raise ValueError(f"surgery: {proj} of this layer is wrapped by an adapter ({type(p).__name__} around "
                                 f"{type(base).__name__}, PEFT) at {qual!r}: merge_and_unload() first, so that the "
                                 "resized projections keep what the adapter adds")
            # modules_to_save: which copy computes depends on the active adapter, so neither is the module's weight
            raise ValueError(f"surgery: {proj} of this layer is wrapped by an adapter ({type(p).__name__} around "
                             f"{type(base).__name__}, PEFT modules_to_save: a trained copy of it per adapter) at "
                             f"{qual!r}: merge_and_unload() first, which puts the active adapter's copy in its "
                             "place (or unload() to keep the original), then run the surgery")
        if type(p) is not nn.Linear and type(p).__name__ != "ProjectionView":
            raise TypeError(f"surgery: {proj} of this layer is a {type(p).__name__} (an adapter wrapper?); "
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
    if b is not None:  # a bias keeps its own flag: BitFit trains biases alone, and a frozen bias stays frozen
        old_b = like.bias if isinstance(getattr(like, "bias", None), torch.Tensor) else like.weight
        lin.bias = nn.Parameter(b.clone(), requires_grad=old_b.requires_grad)
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


# Read off a fresh module, so every kind of hook this torch version has (forward, backward, state-dict, ...) goes.
_HOOK_DICTS = tuple(k for k, v in vars(nn.Module()).items() if "hooks" in k and isinstance(v, dict))


def take_hooks(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` (a deep copy of ``old`` with new projections) the very hook dicts of ``old`` and of each of
    its modules the copy kept (rotary, norms), not the copies ``deepcopy`` made: the handles the user holds
    refer to those dicts, so ``handle.remove()`` still reaches the hooks of the layer that replaced ``old``."""
    copies = dict(new.named_modules())
    own = {id(m) for m in old.modules()}
    for name, module in old.named_modules():
        twin = copies.get(name)
        if twin is None or name in ("q_proj", "k_proj", "v_proj", "out_proj"):  # new modules: no hooks
            continue
        for key in _HOOK_DICTS:
            hooks = module.__dict__.get(key)
            # a module's hook on itself (a bound method) was rebound to the copy by deepcopy: keep the copy's
            if isinstance(hooks, dict) and not any(id(getattr(h, "__self__", None)) in own for h in hooks.values()):
                twin.__dict__[key] = hooks


def _seamless_view(layer: MultiHeadAttention, what: str, which: str) -> str:
    """Why surgery refuses a view whose host has no surgery seam (``from_torch(m, share=True)``): it changes head
    counts, which the view cannot do to weights it does not own."""
    host = type(layer.host).__name__
    if isinstance(layer.host, nn.MultiheadAttention):
        return (f"{what}: {which} is a view sharing an nn.MultiheadAttention's parameters (from_torch(m, "
                f"share=True)); it cannot change head counts in place (nn.MultiheadAttention ties its heads to "
                f"embed_dim = n_heads * d_head): take a copy with from_torch(m) (without share) and run {what} on it")
    return (f"{what}: {which} is a view of a {host}'s weights with no surgery seam, so its head counts cannot change "
            f"in place; run {what} on a standalone copy of the layer")


# -- one surgery over a layer or a model ---------------------------------------------------------------------
class Target:
    """The layers of ``target`` that surgery addresses, by position (as :func:`headwise.trace` numbers them)
    or module name, and the one place that applies new weights to them."""

    def __init__(self, target: Any, what: str) -> None:
        if isinstance(target, MultiHeadAttention) and hosts.has_seam(target):
            raise TypeError(f"{what}: this layer is the view of a patched Hugging Face module; pass the patched "
                            "model (surgery resizes the module's own weights)")
        if isinstance(target, MultiHeadAttention) and hosts.is_view(target):
            raise TypeError(_seamless_view(target, what, "this layer"))
        self.target, self.what = target, what
        try:
            self.layers = find_layers(target)
        except TypeError as e:
            raise TypeError(f"{what}: expected a MultiHeadAttention, a module containing them or a model patched "
                            f"by headwise.interop.patch; got {type(target).__name__} ({e})") from None
        for name, layer in self.layers:  # before any weight is read: its projections are the host's, not Linears
            if hosts.is_view(layer) and not hosts.has_seam(layer):
                raise TypeError(_seamless_view(layer, what, f"layer {name!r}"))
        self.hf = any(hosts.is_view(layer) for _, layer in self.layers)
        # every name of each layer: a layer registered twice (nn.ModuleList([attn] * 3)) is listed once
        self.names: dict[int, list[str]] = {i: [name] for i, (name, _) in enumerate(self.layers)}
        if not self.hf and not isinstance(target, MultiHeadAttention):
            at = {id(layer): i for i, (_, layer) in enumerate(self.layers)}
            for name, module in target.named_modules(remove_duplicate=False):
                i = at.get(id(module))
                if i is not None and name not in self.names[i]:
                    self.names[i].append(name)
        sharded = [n or type(m).__name__ for n, m in self.layers if type(m).__name__ == "TensorParallelAttention"]
        if sharded:
            raise TypeError(f"{what}: {sharded} already hold only this rank's heads (tensor_parallel); change the "
                            "whole layer, then shard it again")

    def index(self, ref: Any) -> int:
        names = [n for n, _ in self.layers]
        n = len(self.layers)
        if isinstance(ref, str):
            found = [i for i, aliases in self.names.items() if ref in aliases]
            if not found:
                raise ValueError(f"{self.what}: no layer is named {ref!r}; expected one of {names}")
            return found[0]
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
            layer = self.layers[i][1]
            replacement = new_layer(layer, hw)
            origin.record(replacement, kept[i])
            take_hooks(layer, replacement)
            for name in self.names[i]:  # under every name, so a shared layer stays one shared layer
                parent, _, child = name.rpartition(".")
                setattr(self.target.get_submodule(parent), child, replacement)
        return self.target


def check_all(items: Mapping[int, Any], check: Callable[[int, Any], HeadWeights]) -> dict[int, HeadWeights]:
    """Every layer's new weights, computed (and so validated) before anything is written."""
    return {i: check(i, v) for i, v in items.items()}
