"""Where surgery reads and writes a layer: a bare :class:`~headwise.MultiHeadAttention`, the layers inside a
module, or the attention modules of a model patched by :func:`headwise.interop.patch`.

* A bare layer is never changed: surgery returns a new, smaller copy (same class, rotary, backend, norms).
* Inside a plain module, each changed layer is replaced by its new copy under the same name.
* In a patched Hugging Face model the host's own modules are resized in place (new ``nn.Linear`` /
  ``Conv1D`` under the same names, the head-count attributes HF's forward reads, and Llama-family
  ``num_attention_heads`` / ``num_key_value_heads`` when every layer agrees), then the model is re-patched
  so every ``.attn`` view describes the new shapes; ``unpatch`` gives a plain HF model computing the same.

Shapes:
    h: query heads, h_kv: key/value heads, d: model width, d_h: head width.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..attention import MultiHeadAttention
from ..trace import find_layers
from .weights import HeadWeights

__all__ = ["Target", "read", "family_of", "check_host", "write_host", "host_module", "new_layer"]


def read(layer: MultiHeadAttention) -> HeadWeights:
    """The layer's current weights (detached; views, no copy) as :class:`HeadWeights`."""
    projs = [getattr(layer, n) for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
    for name, p in zip(("q_proj", "k_proj", "v_proj", "out_proj"), projs):
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


# -- Hugging Face hosts ------------------------------------------------------------------------------------
def family_of(layer: MultiHeadAttention) -> str | None:
    """``"bert"``, ``"gpt2"``, ``"llama"`` for the view of a patched HF module; None for a bare layer."""
    if not hasattr(type(layer), "host") or "_hw_host" not in layer.__dict__:
        return None
    from ..interop import hf_bert, hf_gpt2, hf_llama

    for name, family in (("bert", hf_bert.BertView), ("gpt2", hf_gpt2.GPT2View), ("llama", hf_llama.LlamaView)):
        if isinstance(layer, family):
            return name
    raise TypeError(f"surgery: {type(layer).__name__} is a view of a module surgery does not know how to resize")


def host_module(model: nn.Module, name: str, family: str) -> nn.Module:
    """The HF module surgery resizes for the patched layer ``name``: BERT's ``BertAttention`` (owner of
    ``self`` and ``output.dense``), else the attention module itself."""
    return model.get_submodule(name.rpartition(".")[0] if family == "bert" else name)


def check_host(family: str | None, hw: HeadWeights, where: str) -> None:
    """Refuse shapes the family's Hugging Face module cannot run (BERT and GPT-2 have no K/V groups)."""
    if family in ("bert", "gpt2") and hw.n_kv_heads != hw.n_heads:
        raise ValueError(f"{where}: {family.upper()} attention has one K/V head per query head; this change needs "
                         f"n_heads={hw.n_heads} with n_kv_heads={hw.n_kv_heads} (regroup a standalone copy instead: "
                         "headwise.interop.from_hf, then to_gqa)")


def write_host(module: nn.Module, family: str, hw: HeadWeights) -> None:
    """Resize one Hugging Face attention module to ``hw`` (new modules under the same names)."""
    d_h, h, h_kv = hw.d_head, hw.n_heads, hw.n_kv_heads
    check_host(family, hw, type(module).__name__)
    if family == "bert":
        sa = module.self
        sa.query, sa.key, sa.value = (_linear(w, b, sa.query) for w, b in
                                      ((hw.q_w, hw.q_b), (hw.k_w, hw.k_b), (hw.v_w, hw.v_b)))
        module.output.dense = _linear(hw.o_w, hw.o_b, module.output.dense)
        sa.num_attention_heads, sa.all_head_size = h, h * d_h
    elif family == "llama":
        module.q_proj = _linear(hw.q_w, hw.q_b, module.q_proj)
        module.k_proj = _linear(hw.k_w, hw.k_b, module.k_proj)
        module.v_proj = _linear(hw.v_w, hw.v_b, module.v_proj)
        module.o_proj = _linear(hw.o_w, hw.o_b, module.o_proj)
        module.num_heads, module.num_key_value_heads, module.num_key_value_groups = h, h_kv, h // h_kv
    elif family == "gpt2":
        from transformers.pytorch_utils import Conv1D

        old_attn, old_proj = module.c_attn, module.c_proj
        c_attn, c_proj = Conv1D(3 * h * d_h, hw.q_w.shape[1]), Conv1D(hw.o_w.shape[0], h * d_h)
        c_attn.weight = nn.Parameter(torch.cat([hw.q_w.T, hw.k_w.T, hw.v_w.T], dim=1).contiguous())  # (d, 3 h d_h)
        c_attn.bias = nn.Parameter(torch.cat([hw.q_b, hw.k_b, hw.v_b]).clone())
        c_proj.weight = nn.Parameter(hw.o_w.T.contiguous())  # (h d_h, d)
        c_proj.bias = nn.Parameter(hw.o_b.clone())
        module.c_attn, module.c_proj = c_attn.train(old_attn.training), c_proj.train(old_proj.training)
        module.num_heads, module.split_size = h, h * d_h
    else:  # pragma: no cover - family_of names only these
        raise ValueError(f"unknown family {family!r}")


def sync_llama_config(model: nn.Module) -> None:
    """Set ``num_attention_heads`` / ``num_key_value_heads`` / ``head_dim`` of a Llama-family config when
    every attention module of ``model`` has the same head counts (then plain ``from_pretrained`` loads it)."""
    from ..interop import hf_llama

    mods = [m for m in model.modules() if isinstance(m, hf_llama.classes())]
    if not mods:
        return
    counts = {(m.q_proj.weight.shape[0] // m.head_dim, m.k_proj.weight.shape[0] // m.head_dim) for m in mods}
    for m in mods:
        m.num_heads = m.q_proj.weight.shape[0] // m.head_dim
        m.num_key_value_heads = m.k_proj.weight.shape[0] // m.head_dim
        m.num_key_value_groups = m.num_heads // m.num_key_value_heads
    cfg = mods[0].config
    if len(counts) == 1 and all(m.config is cfg for m in mods):
        (h, h_kv), = counts
        cfg.head_dim = mods[0].head_dim
        cfg.num_attention_heads, cfg.num_key_value_heads = h, h_kv


# -- one surgery over a layer or a model ---------------------------------------------------------------------
class Target:
    """The layers of ``target`` that surgery addresses, by position (as :func:`headwise.trace` numbers them)
    or module name, and the one place that applies new weights to them."""

    def __init__(self, target: Any, what: str) -> None:
        if isinstance(target, MultiHeadAttention) and family_of(target) is not None:
            raise TypeError(f"{what}: this layer is the view of a patched Hugging Face module; pass the patched "
                            "model (surgery resizes the module's own weights)")
        self.target, self.what = target, what
        try:
            self.layers = find_layers(target)
        except TypeError as e:
            raise TypeError(f"{what}: expected a MultiHeadAttention, a module containing them or a model patched "
                            f"by headwise.interop.patch; got {type(target).__name__} ({e})") from None
        self.families = [family_of(layer) for _, layer in self.layers]
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
        if isinstance(self.target, MultiHeadAttention):
            return new_layer(self.target, new[0]) if 0 in new else self.target
        if any(f is not None for f in self.families):
            return self._apply_hf(new)
        for i, hw in new.items():
            name, layer = self.layers[i]
            parent, _, child = name.rpartition(".")
            setattr(self.target.get_submodule(parent), child, new_layer(layer, hw))
        return self.target

    def _apply_hf(self, new: Mapping[int, HeadWeights]) -> Any:
        from ..interop import patch, unpatch

        hosts = {i: host_module(self.target, self.layers[i][0], self.families[i]) for i in new}
        for i, hw in new.items():  # every refusal before the first change
            check_host(self.families[i], hw, f"{self.what} at {self.layers[i][0]!r}")
        unpatch(self.target)
        for i, hw in new.items():
            write_host(hosts[i], self.families[i], hw)
        if "llama" in self.families:
            sync_llama_config(self.target)
        return patch(self.target)


def check_all(items: Mapping[int, Any], check: Callable[[int, Any], HeadWeights]) -> dict[int, HeadWeights]:
    """Every layer's new weights, computed (and so validated) before anything is written."""
    return {i: check(i, v) for i, v in items.items()}
