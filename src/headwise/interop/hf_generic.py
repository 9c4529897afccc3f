"""Any Hugging Face attention module on transformers' attention interface, as a headwise layer (the generic path).

:func:`headwise.interop.patch` uses this for every attention module that calls ``ALL_ATTENTION_FUNCTIONS`` and
has no family adapter (:mod:`~headwise.interop.hf_bert`, :mod:`~headwise.interop.hf_gpt2`,
:mod:`~headwise.interop.hf_llama`). The module keeps its own forward (its projections, norms, rotary, cache and
output projection); the model's attention implementation becomes ``"headwise"``, so every head is computed by
:func:`headwise.interop.hf_interface.attention_forward`, which reports it to the module's layer: an
:class:`InterfaceView`, whose projections are located through :mod:`~headwise.interop.hf_registry`.

* Tracing (q, k, v, pattern, z and edits) needs nothing located: it works on every such module.
* ``attn.head(i)`` weight views and ``result`` captures need Q/K/V and W_O located; where they are not, reading
  them raises ``ValueError`` saying why (e.g. CodeGen's sharded ``qkv_proj``).
* Multi-head latent attention (a registry entry with ``latent``): ``attn.head(i)`` is a
  :class:`~headwise.interop.hf_latent.LatentHead` (rows of the up-projections reading shared latents); its
  ``q_proj`` / ``k_proj`` / ``v_proj`` stay unlocated (they are not projections of x), so surgery is refused.
* The layer's own ``forward`` is refused: the module's forward (with its norms and rotary) is the computation.

Shapes:
    b: batch, s: sequence, h: query heads, h_kv: key/value heads, d: model width, d_h: head width (= d_v).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Sequence

import torch
from torch import nn

from ..config import AttentionConfig
from ..head import AttentionHead
from ._hf_common import HeadwiseHFModule
from ._view import PROJECTIONS, LayerView, ProjectionView
from .hf_latent import LatentHead
from .hf_registry import Entry, entry_for
from .hf_seam import SurgerySeam, linear_like, set_counts, take_per_head

__all__ = ["is_target", "from_module", "InterfaceView", "InterleavedHead", "PatchedInterface"]

NAME = "any attention module on transformers' attention interface (ALL_ATTENTION_FUNCTIONS)"


@functools.lru_cache(maxsize=None)
def calls_interface(cls: type) -> bool:
    """Whether ``cls.forward`` calls transformers' attention interface (what ``set_attn_implementation`` checks)."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):  # no source (a compiled or dynamically built class)
        return False


def is_target(module: nn.Module) -> bool:
    """An attention module on the interface, not yet patched, whose registry entry does not say it attends over
    something other than heads (:attr:`~headwise.interop.hf_registry.Entry.not_heads`)."""
    if isinstance(module, HeadwiseHFModule) or not hasattr(module, "config") or not calls_interface(type(module)):
        return False
    cfg = module.config
    return type(module).__name__ not in entry_for(getattr(cfg, "model_type", None), cfg).not_heads


def _count(owners: tuple[Any, ...], names: tuple[str, ...]) -> int | None:
    for owner in owners:
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _linear(owner: nn.Module, names: tuple[str, ...]) -> tuple[str, nn.Linear] | tuple[None, None]:
    for name in names:
        try:
            found = owner.get_submodule(name)
        except AttributeError:
            continue
        if isinstance(found, nn.Linear):
            return name, found
    return None, None


def _sizes(module: nn.Module, entry: Entry) -> tuple[int, int, int, int]:
    """(d, h, h_kv, d_v) from the module's attributes, then its config."""
    cfg = module.config
    owners = (module, cfg)
    h = _count(owners, entry.heads)
    if h is None:
        raise ValueError(f"{type(module).__name__}: cannot find its number of heads (looked for {entry.heads} on "
                         "the module and its config); add an entry to headwise.interop.hf_registry")
    d = _count(owners, entry.width)
    d_v = _count(owners, entry.d_v) or (d // h if d else None)
    if d_v is None:
        raise ValueError(f"{type(module).__name__}: cannot find its head width (looked for {entry.d_v})")
    h_kv = _count((module,), entry.kv_heads) or _kv_from_weights(module, entry, h, d_v)
    groups = _count((module,), ("num_key_value_groups",))
    if h_kv is None:
        h_kv = h // groups if groups else (_count((cfg,), entry.kv_heads) or h)
    return d or h * d_v, h, h_kv, d_v


def _kv_from_weights(module: nn.Module, entry: Entry, h: int, d_v: int) -> int | None:
    """K/V heads from the key projection's width (configs may carry a num_key_value_heads a family ignores)."""
    if entry.unlocated:
        return None
    if entry.qkv is not None:
        fused = getattr(module, entry.qkv, None)
        rest = fused.out_features - h * d_v if isinstance(fused, nn.Linear) else 0
        return rest // (2 * d_v) if rest > 0 and rest % (2 * d_v) == 0 else None
    _, k = _linear(module, entry.k)
    return k.out_features // d_v if k is not None and k.out_features % d_v == 0 else None


class Path:
    """A projection found at ``path`` below ``owner``, looked up on every call (it may be replaced)."""

    def __init__(self, owner: nn.Module, path: str) -> None:
        self.owner, self.path = owner, path

    def __call__(self) -> nn.Module:
        return self.owner.get_submodule(self.path)

    def replace(self, new: nn.Module) -> None:
        parent, _, attr = self.path.rpartition(".")
        setattr(self.owner.get_submodule(parent) if parent else self.owner, attr, new)


class FusedRows:
    """One projection's rows of a fused Q/K/V ``host.<name>``, read on every access: a block ``[a, b)``, or
    (``interleaved``) rows ``j`` of each of ``h`` heads of ``d_h`` (head-major ``[q_i, k_i, v_i]``: not one slice,
    so that weight is a copy). An object, not a closure, so a deep copy or a pickle of the model follows its
    own host."""

    def __init__(self, host: nn.Module, name: str, a: int = 0, b: int = 0, *, interleaved: tuple[int, int, int]
                 | None = None) -> None:
        self.host, self.name, self.a, self.b, self.interleaved = host, name, a, b, interleaved

    def weight(self) -> torch.Tensor:
        w = getattr(self.host, self.name).weight
        if self.interleaved is None:
            return w[self.a:self.b]
        h, d_h, j = self.interleaved
        return w.view(h, 3, d_h, w.shape[-1])[:, j].reshape(h * d_h, w.shape[-1])

    def bias(self) -> torch.Tensor | None:
        t = getattr(self.host, self.name).bias
        if t is None or self.interleaved is None:
            return None if t is None else t[self.a:self.b]
        h, d_h, j = self.interleaved
        return t.view(h, 3, d_h)[:, j].reshape(h * d_h)

    def view(self, what: str) -> ProjectionView:
        return ProjectionView(self.weight, self.bias, what=what)


def _locate_qkv(module: nn.Module, entry: Entry, h: int, h_kv: int, d_v: int) -> tuple[dict[str, Any], str]:
    """``({q_proj, k_proj, v_proj} -> callable or ProjectionView, "")``, or ``({}, why not)``."""
    owner = type(module).__name__
    if entry.unlocated:
        return {}, entry.unlocated
    if entry.qkv is not None:
        fused = getattr(module, entry.qkv, None)
        want = (h + 2 * h_kv) * d_v
        if not isinstance(fused, nn.Linear) or fused.out_features != want:
            got = fused.out_features if isinstance(fused, nn.Linear) else type(fused).__name__
            return {}, f"{owner}.{entry.qkv} is not an nn.Linear with (h + 2 h_kv) d_h = {want} outputs (got {got})"
        name = entry.qkv
        if entry.layout == "blocks":
            q, k = h * d_v, (h + h_kv) * d_v
            return {"q_proj": FusedRows(module, name, 0, q).view(f"{name}[:{q}]"),
                    "k_proj": FusedRows(module, name, q, k).view(f"{name}[{q}:{k}]"),
                    "v_proj": FusedRows(module, name, k, want).view(f"{name}[{k}:]")}, ""
        if h_kv != h:
            return {}, f"{owner}.{name}: a head-interleaved Q/K/V layout needs h_kv == h, got {h_kv} and {h}"
        return {p: FusedRows(module, name, interleaved=(h, d_v, j)).view(f"{name} ({'qkv'[j]} rows of each head)")
                for j, p in enumerate(("q_proj", "k_proj", "v_proj"))}, ""
    found = {hw: _linear(module, names) for hw, names in (("q_proj", entry.q), ("k_proj", entry.k),
                                                          ("v_proj", entry.v))}
    missing = [hw for hw, (name, _) in found.items() if name is None]
    if missing:
        return {}, f"{owner} has no nn.Linear named {' / '.join(entry.q + entry.k + entry.v)} for {missing}"
    (qn, q), (kn, k), (vn, v) = found.values()
    want = {"q_proj": h * d_v, "k_proj": h_kv * d_v, "v_proj": h_kv * d_v}
    got = {"q_proj": q.out_features, "k_proj": k.out_features, "v_proj": v.out_features}
    if got != want:
        return {}, f"{owner}: the projections have {got} outputs, h={h}, h_kv={h_kv}, d_h={d_v} need {want}"
    if len({q.bias is None, k.bias is None, v.bias is None}) != 1:
        return {}, f"{owner}: some of {qn}, {kn}, {vn} have a bias and some do not"
    return {hw: Path(module, name) for hw, (name, _) in found.items()}, ""


def _locate_o(module: nn.Module, parent: nn.Module | None, entry: Entry, d: int, inner: int) -> tuple[Any, str]:
    for owner, names in ((module, entry.o), (parent, entry.o_parent)):
        if owner is None:
            continue
        name, o = _linear(owner, names)
        if o is not None and o.in_features == inner and o.out_features == d:
            return Path(owner, name), ""
    where = f"{entry.o} on {type(module).__name__}" + (f" or {entry.o_parent} on {type(parent).__name__}"
                                                      if parent is not None else "")
    return None, f"no nn.Linear ({d}, {inner}) named {where}"


def from_module(module: nn.Module, parent: nn.Module | None = None, *, name: str = "") -> "InterfaceView":
    """The :class:`InterfaceView` of one attention module (``parent``: its enclosing module, for W_O found there).

    Nothing is read or allocated. Raises ``ValueError`` if the head counts cannot be found or do not divide.

    Shapes:
        module (d, h, h_kv, d_v) -> InterfaceView(d, h, h_kv, d_head=d_v)
    """
    cfg = module.config
    entry = entry_for(getattr(cfg, "model_type", None), cfg)
    d, h, h_kv, d_v = _sizes(module, entry)
    where: dict[str, Any] = {}
    qkv, why_qkv = _locate_qkv(module, entry, h, h_kv, d_v)
    o, why_o = _locate_o(module, parent, entry, d, h * d_v)
    for hw in ("q_proj", "k_proj", "v_proj"):
        where[hw] = qkv.get(hw, f"Q/K/V are not located: {why_qkv}")
    where["out_proj"] = o if o is not None else f"W_O is not located: {why_o}"
    resolved = {hw: (w() if callable(w) and not isinstance(w, ProjectionView) else w) for hw, w in where.items()
                if not isinstance(w, str)}
    bias = bool(qkv) and resolved["q_proj"].bias is not None
    kdim = resolved["k_proj"].weight.shape[1] if qkv else None
    vdim = resolved["v_proj"].weight.shape[1] if qkv else None
    scale = getattr(module, "scaling", None)
    scale = float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0 else None
    config = AttentionConfig(d_model=d, n_heads=h, n_kv_heads=h_kv, d_head=d_v, bias=bias, scale=scale,
                             out_bias=o is not None and resolved["out_proj"].bias is not None, kdim=kdim, vdim=vdim)
    sources = [(hw, m if isinstance(m, nn.Module) else getattr(module, entry.qkv)) for hw, m in resolved.items()]
    backend = "eager" if getattr(cfg, "_attn_implementation", None) == "eager" else "sdpa"
    return InterfaceView.build(config, module, backend=backend, name=name, _hw_where=where, _hw_sources=sources,
                               _hw_layout=entry.layout if qkv else "split", _hw_fused=entry.qkv,
                               _hw_latent=entry.latent)


class InterfaceView(SurgerySeam, LayerView):
    """The headwise layer of a module patched on the generic path: its config (head counts, widths, scale) and its
    located projections; the module's own forward computes, through the attention interface.

    Shapes:
        as :class:`~headwise.MultiHeadAttention` (d, h, h_kv, d_head = d_v); ``attn.head(i)`` where Q/K/V are located
    """

    _hw_where: dict[str, Any]
    _hw_sources: list[tuple[str, nn.Module]]
    _hw_latent = None  # the registry's Latent for multi-head latent attention

    def resolve(self, name: str) -> Any:
        where = self._hw_where[name]
        if isinstance(where, str):
            needs = ("'result' captures, head W_O views, " if name == "out_proj" else
                     "" if self._hw_latent is not None else "head weight views, ")
            raise ValueError(f"{self._hw_name or type(self.host).__name__}: {name} (and what needs it: {needs}"
                             f"surgery) is unavailable: {where}")
        return where if isinstance(where, ProjectionView) else where()

    def sources(self) -> list[tuple[str, nn.Module]]:
        return list(self._hw_sources)

    def source_names(self) -> dict[str, str]:
        names = {}
        for hw in PROJECTIONS:
            where = self._hw_where[hw]
            names[hw] = ("not located" if isinstance(where, str) else where.what if isinstance(where, ProjectionView)
                         else type(where()).__name__)
        return names

    @property
    def located(self) -> dict[str, str]:
        """``{projection: "" if located else why not}`` for q_proj, k_proj, v_proj, out_proj."""
        return {hw: (w if isinstance(w, str) else "") for hw, w in self._hw_where.items()}

    def head(self, index: int) -> AttentionHead | LatentHead:
        """Head ``index`` as weight views (see :meth:`MultiHeadAttention.head`); Q/K/V must be located. Its own
        forward is plain attention: the family's norms and rotary are applied only by the module's forward.
        Under multi-head latent attention it is a :class:`~headwise.interop.hf_latent.LatentHead`."""
        if self._hw_latent is not None:
            return LatentHead(self, index, self._hw_latent)
        self.resolve("q_proj")  # refuse with the reason before building a head
        head = super().head(index)
        if self._hw_layout == "per_head":
            head.__class__ = InterleavedHead
            object.__setattr__(head, "_hw_layer", self)
        return head

    def write_heads(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]], n_heads: int,
                    n_kv_heads: int, heads_from: Sequence[int] | None = None) -> None:
        """Give the host module new projections holding ``weights`` (``{q_proj, k_proj, v_proj, out_proj:
        (weight (out, in), bias)}``) for ``n_heads`` / ``n_kv_heads`` heads of this layer's width (the surgery
        seam, :mod:`~headwise.interop.hf_seam`): new modules under the same names (a fused Q/K/V in its own
        layout), the per-head parameters of heads ``heads_from``, and the head counts set where the module and
        the next patch read them. Refuses (``ValueError``, nothing changed) what :meth:`edit_refusal` refuses.

        Shapes:
            q_proj (h * d_h, d), k_proj / v_proj (h_kv * d_h, d), out_proj (d, h * d_h)
        """
        self.refuse_edit(n_heads, n_kv_heads)
        d_h, host, entry = self.d_head, self.host, self.surgery_entry()
        (qw, qb), (kw, kb), (vw, vb) = (weights[p] for p in ("q_proj", "k_proj", "v_proj"))
        if (qw.shape[0], kw.shape[0], vw.shape[0]) != (n_heads * d_h, n_kv_heads * d_h, n_kv_heads * d_h):
            raise ValueError(f"write_heads: Q/K/V rows {qw.shape[0]}, {kw.shape[0]}, {vw.shape[0]} do not hold "
                             f"h={n_heads}, h_kv={n_kv_heads} heads of d_h={d_h}")
        new = {"out_proj": weights["out_proj"]}
        if self._hw_layout == "split":
            new.update({"q_proj": (qw, qb), "k_proj": (kw, kb), "v_proj": (vw, vb)})
        else:
            if self._hw_layout == "per_head":  # head-major [q_i, k_i, v_i] rows (edit_refusal: h == h_kv)
                rows = [t.view(n_heads, 1, d_h, -1) for t in (qw, kw, vw)]
                fused_w = torch.cat(rows, 1).reshape(3 * n_heads * d_h, -1)
                fused_b = None if qb is None else torch.cat([t.view(n_heads, 1, d_h) for t in (qb, kb, vb)], 1
                                                            ).reshape(-1)
            else:
                fused_w = torch.cat([qw, kw, vw])
                fused_b = None if qb is None else torch.cat([qb, kb, vb])
            setattr(host, self._hw_fused, linear_like(fused_w, fused_b, getattr(host, self._hw_fused)))
        for p, (w, b) in new.items():
            where = self._hw_where[p]
            where.replace(linear_like(w, b, where()))
        take_per_head(host, entry, heads_from, n_heads)
        set_counts(host, entry, n_heads, n_kv_heads, d_h)
        if _count((host, host.config), entry.d_v) is None:
            host.head_dim = d_h  # the next patch would otherwise derive it from d / h
        host.num_heads, host.num_key_value_heads = n_heads, n_kv_heads  # what the next patch reads first

    def edit_refusal(self, n_heads: Any, n_kv_heads: Any) -> str:
        why = super().edit_refusal(n_heads, n_kv_heads)
        if not why and self._hw_layout == "per_head" and n_heads != n_kv_heads:
            why = (f"{self._hw_name or type(self.host).__name__}: a head-interleaved Q/K/V "
                   f"({self._hw_fused}) needs n_heads == n_kv_heads, got {n_heads}, {n_kv_heads}")
        return why

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
            return False  # (located: "" where found)
        if not self.located["out_proj"] and self.resolve("out_proj").weight.shape[1] != n_heads * self.d_head:
            return False
        object.__setattr__(self, "config", dataclasses.replace(self.config, n_heads=n_heads, n_kv_heads=n_kv_heads))
        return True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{type(self).__name__} of {self._hw_name or type(self.host).__name__} does not run on its "
                        "own: call the model (its module applies the family's norms and rotary, then headwise "
                        "computes every head through transformers' attention interface)")


class InterleavedHead(AttentionHead):
    """A head of a head-interleaved fused Q/K/V (GPT-NeoX ``query_key_value``): its weights are live views of
    that head's rows ``[q_i, k_i, v_i]`` of the fused weight.

    Shapes:
        w_q, w_k, w_v: (d, d_h); b_*: (d_h,) or None
    """

    def _view(self, j: int, bias: bool) -> torch.Tensor | None:
        layer = self.__dict__["_hw_layer"]
        fused = getattr(layer.host, layer._hw_fused)
        h, d_h = layer.n_heads, layer.d_head
        if bias:
            return None if fused.bias is None else fused.bias.view(h, 3, d_h)[self.index, j]  # (d_h,)
        return fused.weight.view(h, 3, d_h, -1)[self.index, j].T  # (d, d_h)

    def _write(self, j: int, bias: bool, value: torch.Tensor) -> None:
        target = self._view(j, bias)
        if target is None:
            raise ValueError("this head has no bias (the fused projection has none)")
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"expected shape {tuple(target.shape)}, got {tuple(value.shape)}")
        with torch.no_grad():
            target.copy_(value)

    w_q = property(lambda self: self._view(0, False), lambda self, v: self._write(0, False, v))
    w_k = property(lambda self: self._view(1, False), lambda self, v: self._write(1, False, v))
    w_v = property(lambda self: self._view(2, False), lambda self, v: self._write(2, False, v))
    b_q = property(lambda self: self._view(0, True), lambda self, v: self._write(0, True, v))
    b_k = property(lambda self: self._view(1, True), lambda self, v: self._write(1, True, v))
    b_v = property(lambda self: self._view(2, True), lambda self, v: self._write(2, True, v))


class PatchedInterface:
    """Mixin of a module patched on the generic path: no forward of its own (the module's computes, and its
    attention interface call reaches headwise)."""

