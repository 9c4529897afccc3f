"""The headwise layer of a Hugging Face attention module: :class:`HFView`, a live view of the module's weights.

:func:`headwise.interop.patch` gives every attention module that calls transformers' attention interface one
(:func:`view_of`), reachable as ``module.attn`` and through :func:`~headwise.interop.layers`. The module keeps its
own forward (projections, norms, rotary, cache, output projection); every head it hands to the interface is
computed by :meth:`~headwise.MultiHeadAttention.attend` on this layer, where :func:`headwise.trace` sees and edits
it. What the layer knows of the module comes from the family's registry entry
(:mod:`~headwise.interop.hf.registry`) through :mod:`~headwise.interop.hf.locate`:

* tracing (q, k, v, pattern, z and edits) needs nothing located: it works on every such module;
* ``attn.head(i)`` weight views, ``result`` captures, surgery and :func:`~headwise.interop.from_hf` need Q/K/V and
  W_O located; where they are not, reading them raises ``ValueError`` saying why (CodeGen's sharded ``qkv_proj``);
* ``attn.rotary`` and per-head QK-norm follow the entry (Llama-style rope, Qwen3's ``q_norm`` / ``k_norm``), so a
  head run alone computes what it computes in the module; the layer's own forward (``attn(x)``) runs only where
  the entry says the module is nothing more (``standalone``) and no adapter or hook on a fused Q/K/V adds to it;
* multi-head latent attention (an entry with ``latent``): ``attn.head(i)`` is a
  :class:`~headwise.interop.hf.latent.LatentHead`.

Shapes:
    b: batch, s: sequence, h: query heads, h_kv: key/value heads, d: model width, d_h: head width (= d_v).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch
from torch import nn

from ...config import AttentionConfig
from ...head import AttentionHead
from ...rotary import RotaryEmbedding
from ...stored_weights import recomputed_weight
from ...validation import check_tensor
from ..views import LayerView
from .latent import LatentHead
from .locate import Located, is_conv1d, locate
from .qk_norm import QKNormAttention, QKNormMixin
from .registry import Entry, entry_for
from .rope import rotary_from_hf
from .surgery import SurgerySeam

__all__ = ["calls_interface", "names_rotary", "family_entry", "is_target", "view_of", "HFView", "QKNormHFView",
           "InterleavedHead", "RULES"]

#: How a patched module attends: the rule of the implementation its model had before :func:`patch` (padded rows,
#: missing masks and returned weights follow it; see :mod:`~headwise.interop.hf.attention_function`).
RULES = ("eager", "sdpa")


@functools.lru_cache(maxsize=None)
def calls_interface(cls: type) -> bool:
    """Whether ``cls.forward`` calls transformers' attention interface: its code refers to
    ``ALL_ATTENTION_FUNCTIONS``, or calls ``super()`` and a base class's forward does (the names of the compiled
    code: no source is read)."""
    return _forward_names(cls, lambda names: "ALL_ATTENTION_FUNCTIONS" in names)


@functools.lru_cache(maxsize=None)
def names_rotary(cls: type) -> bool:
    """Whether ``cls.forward`` (or a base class's forward it calls through ``super()``) names a rotary embedding:
    a name of its compiled code with a word ``rotary`` or ``rope`` (``apply_rotary_pos_emb``, ``rotary_emb``,
    ``qk_rope_head_dim``), as transformers' modules that rotate Q and K before the attention interface do. Module
    families whose ``position_embeddings`` are added to x (DETR) name none. No source is read."""
    return _forward_names(cls, lambda names: any(word in ("rotary", "rope") for name in names
                                                 for word in name.lower().split("_")))


def _forward_names(cls: type, test: Any) -> bool:
    """Whether ``test`` holds for the names of ``cls.forward``'s compiled code, or of a base class's forward it
    reaches through ``super()``."""
    for klass in cls.__mro__:
        forward = klass.__dict__.get("forward")
        if forward is None:
            continue
        code = getattr(inspect.unwrap(forward), "__code__", None)
        if code is None:
            return False
        if test(code.co_names):
            return True
        if "super" not in code.co_names:
            return False
    return False


def family_entry(module: nn.Module) -> Entry:
    """The registry entry of ``module``'s family (its config's ``model_type``)."""
    cfg = getattr(module, "config", None)
    return entry_for(getattr(cfg, "model_type", None), cfg)


def is_target(module: nn.Module) -> bool:
    """An attention module on the interface whose registry entry does not say it attends over something other
    than heads (:attr:`~headwise.interop.hf.registry.Entry.not_heads`)."""
    if not hasattr(module, "config") or not calls_interface(type(module)):
        return False
    return type(module).__name__ not in family_entry(module).not_heads


def _dropout(module: nn.Module, entry: Entry) -> float:
    for name in entry.dropout:
        value = getattr(module, name, None)
        value = getattr(value, "p", value)  # an nn.Dropout
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1:
            return float(value)
    return 0.0


def _per_head_norms(module: nn.Module, entry: Entry, d_qk: int) -> str:
    """Why the entry's QK-norms are not per-head norms of this module ("" when they are)."""
    for name in entry.qk_norm or ():
        norm = getattr(module, name, None)
        weight = getattr(norm, "weight", None)
        if not isinstance(norm, nn.Module) or (weight is not None and tuple(weight.shape) != (d_qk,)):
            return f"{type(module).__name__}.{name} is not a norm over each head's d_h={d_qk} features"
    return ""


def view_of(module: nn.Module, parent: nn.Module | None = None, *, name: str = "", rule: str = "sdpa") -> "HFView":
    """The :class:`HFView` of one attention module (``parent``: its enclosing module, where W_O may live).

    Nothing is read or allocated. Raises ``ValueError`` if the head counts cannot be found.

    Shapes:
        module (d, h, h_kv, d_v) -> HFView(d, h, h_kv, d_head=d_v)
    """
    entry = family_entry(module)
    found = locate(module, parent, entry)
    resolved = {hw: w.view() for hw, w in found.where.items() if not isinstance(w, str)}
    qkv = "q_proj" in resolved
    scale = getattr(module, "scaling", None)
    scale = float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0 else None
    q_in = resolved["q_proj"].weight.shape[1] if qkv else None
    config = AttentionConfig(
        d_model=found.d, n_heads=found.h, n_kv_heads=found.h_kv, d_head=found.d_v,
        bias=qkv and resolved["q_proj"].bias is not None, scale=scale, dropout=_dropout(module, entry),
        out_bias="out_proj" in resolved and resolved["out_proj"].bias is not None,
        kdim=resolved["k_proj"].weight.shape[1] if qkv else None,
        vdim=resolved["v_proj"].weight.shape[1] if qkv else None)
    norms = entry.qk_norm is not None and not _per_head_norms(module, entry, found.d_v)
    cls = QKNormHFView if norms else HFView
    view = cls.build(config, module, backend="eager" if rule == "eager" else "sdpa", name=name, _hw_found=found,
                     rule=rule)
    # read here, where the module is at hand: a record names its captures by it after the model may be gone
    object.__setattr__(view, "_hw_rotated", entry.rotary or names_rotary(type(module)))
    if qkv and q_in != found.d:
        object.__setattr__(view, "_hw_odd", f"its queries read width {q_in}, not the model width {found.d}")
    elif found.layout == "kv_blocks":  # attn(x) would read keys and values off x
        object.__setattr__(view, "_hw_odd", "it is cross-attention: its keys and values read the encoder's hidden "
                                            "states, not its input")
    return view


class HFView(SurgerySeam, LayerView):
    """The headwise layer of a patched Hugging Face module: its config (head counts, widths, scale) and located
    projections; the module's forward computes, through the attention interface and :meth:`attend`.

    Shapes:
        as :class:`~headwise.MultiHeadAttention` (d, h, h_kv, d_head = d_v); ``attn.head(i)`` where Q/K/V are located
    """

    _hw_found: Located
    _hw_odd = ""
    _hw_rotated = False
    #: ``"eager"`` or ``"sdpa"``: the implementation whose conventions the module keeps (its model's before
    #: :func:`~headwise.interop.patch`; see :mod:`~headwise.interop.hf.attention_function`).
    rule = "sdpa"

    @property
    def entry(self) -> Entry:
        """The family's registry entry."""
        return self._hw_found.entry

    def resolve(self, name: str) -> Any:
        self._hw_host.get()  # freed with its model: refuse, naming it, rather than hand out a dead window
        where = self._hw_found.where[name]
        if isinstance(where, str):
            needs = ("'result' captures, head W_O views, " if name == "out_proj" else
                     "" if self.entry.latent is not None else "head weight views, ")
            raise ValueError(f"{self._hw_name or type(self.host).__name__}: {name} (and what needs it: {needs}"
                             f"surgery, from_hf) is unavailable: {where}")
        return where.view()

    def projection(self, name: str) -> Any:
        """The located :class:`~headwise.interop.hf.locate.Projection` of ``name`` (refuses as :meth:`resolve`)."""
        self.resolve(name)
        return self._hw_found.where[name]

    def sources(self) -> list[tuple[str, nn.Module]]:
        return [(hw, w.module()) for hw, w in self._hw_found.where.items() if not isinstance(w, str)]

    def source_names(self) -> dict[str, str]:
        return {hw: "not located" if isinstance(w, str) else w.what for hw, w in self._hw_found.where.items()}

    @property
    def located(self) -> dict[str, str]:
        """``{projection: "" if located else why not}`` for q_proj, k_proj, v_proj, out_proj."""
        return {hw: (w if isinstance(w, str) else "") for hw, w in self._hw_found.where.items()}

    @property
    def rotary(self) -> RotaryEmbedding | None:
        """The module's rotary embedding as a :class:`~headwise.RotaryEmbedding` where the registry says the family
        rotates Q and K from its config (derived on first use, no data read); None elsewhere."""
        if self.__dict__.get("_hw_host") is None or not self.entry.rotary:
            return None
        rotary = self.__dict__.get("_hw_rotary")
        if rotary is None:
            rotary = rotary_from_hf(self.host.config, self.config.d_head)
            self.__dict__["_hw_rotary"] = rotary
        return rotary

    @rotary.setter
    def rotary(self, value: RotaryEmbedding | None) -> None:
        if value is not None or self.__dict__.get("_hw_host") is not None:
            raise TypeError("the rotary embedding of a patched layer follows the model's config; it cannot be set")

    @property
    def rotated(self) -> bool:
        """Whether the q and k the module hands over (what a trace captures) come out of a rotary embedding: its
        entry says so (``rotary``), or its forward names one (:func:`names_rotary`: GPT-NeoX, Phi-3, Gemma and the
        other families whose entry leaves ``rotary`` out, so that ``attn.rotary`` is None). A layer of such a
        family that skips the rotation (a NoPE layer) hands over q and k the rotation left as they were."""
        return self._hw_rotated

    def head(self, index: int) -> AttentionHead | LatentHead:
        """Head ``index`` as weight views (see :meth:`MultiHeadAttention.head`); Q/K/V must be located. It applies
        the family's rotary and QK-norm where the registry names them (``attn.rotary``, ``q_norm``); other parts
        of a family's attention run only in the module's forward. Under multi-head latent attention it is a
        :class:`~headwise.interop.hf.latent.LatentHead`."""
        if self.entry.latent is not None:
            return LatentHead(self, index, self.entry.latent)
        self.resolve("q_proj")  # refuse with the reason before building a head
        head = super().head(index)
        if self._hw_found.layout == "per_head":
            head.__class__ = InterleavedHead
            object.__setattr__(head, "_hw_layer", self)
        return head

    def adopt_kv_heads(self, n_kv_heads: int) -> bool:
        """Take the K/V head count transformers hands over when it could not be read from located weights (a
        config may carry a ``num_key_value_heads`` its family ignores); False where the weights fixed it."""
        if any(not self.located[p] for p in ("q_proj", "k_proj", "v_proj")) or self.n_heads % n_kv_heads:
            return False
        object.__setattr__(self, "config", dataclasses.replace(self.config, n_kv_heads=n_kv_heads))
        return True

    def adopt_heads(self, n_heads: int, n_kv_heads: int) -> bool:
        """Take the head counts transformers hands over where no located weight fixes them (Q/K/V not located, so
        the counts were read from attributes a family may use otherwise: JetMoE hands over its top-k experts'
        heads); False where the weights fix them. Tracing then names heads as transformers computes them."""
        if any(not self.located[p] for p in ("q_proj", "k_proj", "v_proj")) or n_heads % n_kv_heads:
            return False
        if not self.located["out_proj"] and self.resolve("out_proj").weight.shape[1] != n_heads * self.d_head:
            return False
        object.__setattr__(self, "config", dataclasses.replace(self.config, n_heads=n_heads, n_kv_heads=n_kv_heads))
        return True

    def bypassed(self) -> str:
        """Why the module's heads no longer pass through this layer ("" while they do): its model was switched to
        another attention implementation since :func:`~headwise.interop.patch`."""
        impl = getattr(self.host.config, "_attn_implementation", None)
        if impl == "headwise":
            return ""
        return (f"{self._hw_name or type(self.host).__name__} computes with attn_implementation={impl!r} since it was "
                "patched (set_attn_implementation); call headwise.interop.patch(model) again")

    def standalone_refusal(self) -> str:
        """Why this layer cannot compute its module's attention on its own ("" when it can): the entry is not
        standalone, a projection is not located, or a fused Q/K/V module computes more than its rows' weights (a
        PEFT adapter, hooks: :meth:`~headwise.interop.hf.locate.Projection.beyond_view`)."""
        where = self._hw_name or type(self.host).__name__
        if not self.entry.standalone:
            return (f"{where}: {type(self.host).__name__}'s attention is more than projections, rotary and a "
                    "softmax as far as headwise.interop.hf.registry knows (its entry is not standalone)")
        why = self._hw_found.why() or self._hw_odd or (_per_head_norms(self.host, self.entry, self.d_head)
                                                       if self.entry.qk_norm else "")
        # A fused Q/K/V's rows are read off its weight: an adapter or hook on it runs in the module's forward only.
        why = why or next((b for p in self._hw_found.where.values() if (b := p.beyond_view())), "")
        return f"{where}: {why}" if why else ""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's attention computed by this layer alone (:meth:`MultiHeadAttention.forward`), where the
        registry says the family is plain enough (``standalone``); refused elsewhere, saying why: call the model,
        whose module applies the family's own parts."""
        why = self.standalone_refusal()
        if why:
            raise TypeError(f"{type(self).__name__} does not run on its own: {why}; call the model instead (its "
                            "module computes every head through headwise)")
        return super().forward(*args, **kwargs)


class QKNormHFView(QKNormMixin, HFView):
    """An :class:`HFView` whose module normalises each head's queries and keys (the registry's ``qk_norm``): the
    norms are the module's own, applied by the layer and its heads (:class:`~headwise.interop.hf.qk_norm.QKNormHead`).

    Shapes:
        as :class:`HFView`; the norms run over d_h of each split head
    """

    @property
    def q_norm(self) -> nn.Module:
        return getattr(self.host, self.entry.qk_norm[0])

    @property
    def k_norm(self) -> nn.Module:
        return getattr(self.host, self.entry.qk_norm[1])

    def sources(self) -> list[tuple[str, nn.Module]]:
        return super().sources() + [("q_norm", self.q_norm), ("k_norm", self.k_norm)]

    def source_names(self) -> dict[str, str]:
        return {**super().source_names(), "q_norm": self.entry.qk_norm[0], "k_norm": self.entry.qk_norm[1]}

    @classmethod
    def from_heads(cls, heads: Any, **kwargs: Any) -> QKNormAttention:
        """Heads packed into a standalone :class:`~headwise.interop.hf.qk_norm.QKNormAttention` with copies of
        their norms (see ``MultiHeadAttention.from_heads``).

        Args:
            heads, kwargs: as :meth:`MultiHeadAttention.from_heads`.
        """
        return QKNormAttention.from_heads(heads, **kwargs)


class InterleavedHead(AttentionHead):
    """A head of a head-interleaved fused Q/K/V (GPT-NeoX ``query_key_value``): its weights are live views of that
    head's rows ``[q_i, k_i, v_i]`` of the fused weight (columns, in a ``Conv1D``).

    Shapes:
        w_q, w_k, w_v: (d, d_h); b_*: (d_h,) or None
    """

    def _view(self, j: int, bias: bool) -> torch.Tensor | None:
        layer = self.__dict__["_hw_layer"]
        fused = getattr(layer.host, layer._hw_found.fused)
        h, d_h = layer.n_heads, layer.d_head
        if bias:
            return None if fused.bias is None else fused.bias.view(h, 3, d_h)[self.index, j]  # (d_h,)
        w = fused.weight.T if is_conv1d(fused) else fused.weight  # (out, in)
        return w.unflatten(0, (h, 3, d_h))[self.index, j].T  # (d, d_h)

    def _write(self, name: str, j: int, bias: bool, value: torch.Tensor) -> None:
        check_tensor(name, value)
        target = self._view(j, bias)
        if target is None:
            raise ValueError("this head has no bias (the fused projection has none)")
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"expected shape {tuple(target.shape)}, got {tuple(value.shape)}")
        layer = self.__dict__["_hw_layer"]
        why = recomputed_weight(getattr(layer.host, layer._hw_found.fused), target)
        if why:
            raise TypeError(f"cannot write {name} of head {self.index}: {layer._hw_found.fused} {why}")
        with torch.no_grad():
            target.copy_(value)

    w_q = property(lambda self: self._view(0, False), lambda self, v: self._write("w_q", 0, False, v))
    w_k = property(lambda self: self._view(1, False), lambda self, v: self._write("w_k", 1, False, v))
    w_v = property(lambda self: self._view(2, False), lambda self, v: self._write("w_v", 2, False, v))
    b_q = property(lambda self: self._view(0, True), lambda self, v: self._write("b_q", 0, True, v))
    b_k = property(lambda self: self._view(1, True), lambda self, v: self._write("b_k", 1, True, v))
    b_v = property(lambda self: self._view(2, True), lambda self, v: self._write("b_v", 2, True, v))

