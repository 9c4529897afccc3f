"""Where one Hugging Face attention module keeps its heads: sizes and projections found through the registry.

:func:`locate` reads a module (and its parent, for a W_O that lives there, as BERT's) with its family's
:class:`~headwise.interop.hf.registry.Entry` and returns a :class:`Located`: the head counts and widths, and for
each of ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` either a :class:`Projection` (a live window onto the
module's weight, read on every access) or the reason it is not located. Nothing is read or allocated, so a module
on the meta device is located as well as a real one.

A projection is an ``nn.Linear`` (weight ``(out, in)``) or transformers' ``Conv1D`` (weight ``(in, out)``: GPT-2),
either possibly wrapped by PEFT (its ``base_layer``); a fused Q/K/V holds the three as row blocks (``"blocks"``)
or head by head (``"per_head"``). Every :class:`Projection` hands out ``(out, in)`` weights and writes them back
in the module's own layout (:meth:`Projection.write`).

Shapes:
    d: model width, h: query heads, h_kv: key/value heads, d_v: value head width (the context's), in: input width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...stored_weights import packed_weight, recomputed_weight
from ...module_calls import adapter_base, has_own_forward_hooks
from ..views import HostRef, ProjectionView
from .registry import Entry

__all__ = ["Located", "Projection", "Whole", "Rows", "locate", "projection_size", "is_conv1d", "is_cross",
           "PROJECTIONS"]

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


def _base(module: Any) -> Any:
    """The layer a PEFT wrapper wraps (its ``base_layer``), else the module itself."""
    return adapter_base(module) or module


def is_conv1d(module: Any) -> bool:
    """Whether ``module`` (or the layer a PEFT wrapper wraps) is transformers' ``Conv1D`` (weight ``(in, out)``)."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(_base(module), Conv1D)


def projection_size(module: Any) -> tuple[int, int] | None:
    """``(out, in)`` of an ``nn.Linear`` or ``Conv1D`` (PEFT-wrapped or not), None for anything else."""
    base = _base(module)
    if isinstance(base, nn.Linear):
        return base.out_features, base.in_features
    if is_conv1d(base):
        w = base.weight
        return w.shape[1], w.shape[0]
    return None


def _unpacked(module: Any, what: str) -> Any:
    """``module``, refused (``TypeError``) where its weight is packed (quantized): every reader here needs floats."""
    why = packed_weight(module)
    if why:
        raise TypeError(f"{what} is {why}")
    return module


def _packed_at(owner: nn.Module, names: tuple[str, ...]) -> str:
    """Why the first of ``names`` below ``owner`` holding a packed (quantized) weight is no projection headwise can
    read ("" where none does): a quantized ``nn.Linear`` is a projection, just not one of float weights."""
    for name in names:
        try:
            found = owner.get_submodule(name)
        except AttributeError:
            continue
        if why := packed_weight(_base(found)):
            return f"{type(owner).__name__}.{name} is {why}"
    return ""


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """In-place copy that refuses a shape change (the module keeps its own layout)."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    if dst.data_ptr() == src.data_ptr() and dst.stride() == src.stride():
        return  # the same storage (a patched model's own view): nothing to copy
    with torch.no_grad():
        dst.copy_(src)


class Projection:
    """One projection of a module, read on every access: ``weight()`` ``(out, in)``, ``bias()``, ``module()`` (what
    the module calls), :meth:`write` (exact, in the module's layout) and :meth:`view` (what the layer resolves)."""

    what = ""

    def module(self) -> nn.Module:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def weight(self) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def bias(self) -> torch.Tensor | None:  # pragma: no cover
        raise NotImplementedError

    def write(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:  # pragma: no cover
        raise NotImplementedError

    def view(self) -> Any:
        return ProjectionView(self.weight, self.bias, what=self.what)

    def beyond_view(self) -> str:
        """Why calling :meth:`module` computes more than calling :meth:`view` ("" where it does not)."""
        return ""

    def unwritable(self) -> str:
        """Why :meth:`write` would not change the module ("" where it would): a weight or bias it recomputes on
        use from other tensors (a parametrization such as ``weight_norm``), so a write would be lost."""
        m = _unpacked(self.module(), self.what)
        return next((f"{self.what}: {type(m).__name__} {why}" for t in (m.weight, m.bias)
                     if t is not None and (why := recomputed_weight(m, t))), "")

    def _check_writable(self) -> None:
        if why := self.unwritable():
            raise TypeError(f"cannot write {why}")


class Whole(Projection):
    """A whole projection module at ``path`` below ``owner`` (looked up on every call: it may be replaced).
    An ``nn.Linear`` resolves to the module itself (so a hook or LoRA on it runs); a ``Conv1D`` to a transposed
    view that calls the module. ``owner`` is held weakly (:class:`~headwise.interop.views.HostRef`): the view
    holding this locator is held by the module, or by a child of it (BERT's W_O lives on the parent)."""

    def __init__(self, owner: nn.Module, path: str) -> None:
        self._owner, self.path, self.what = HostRef(owner), path, path

    @property
    def owner(self) -> nn.Module:
        """The module holding the projection (``ReferenceError`` once it was freed)."""
        return self._owner.get()

    def module(self) -> nn.Module:
        return self.owner.get_submodule(self.path)

    def weight(self) -> torch.Tensor:
        m = _unpacked(self.module(), self.what)
        return m.weight.T if is_conv1d(m) else m.weight  # (out, in)

    def bias(self) -> torch.Tensor | None:
        return _unpacked(self.module(), self.what).bias

    def write(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._check_writable()
        _copy(self.weight(), weight, f"{self.what}.weight")
        if self.bias() is not None:
            _copy(self.bias(), bias, f"{self.what}.bias")

    def view(self) -> Any:
        m = self.module()
        if not is_conv1d(m):
            return m
        return ProjectionView(self.weight, self.bias, call=lambda x: self.module()(x), what=f"{self.path}.weight.T")

    def replace(self, new: nn.Module) -> None:
        parent, _, attr = self.path.rpartition(".")
        setattr(self.owner.get_submodule(parent) if parent else self.owner, attr, new)


class Rows(Projection):
    """One projection's rows of a fused Q/K/V ``host.<name>``: a block ``[a, b)``, or (``interleaved = (h, d_h,
    j)``) rows ``j`` of each of ``h`` heads of ``d_h`` (head-major ``[q_i, k_i, v_i]``: not one slice, so that
    weight is a copy, and :meth:`write` writes each head's rows). A ``Conv1D`` holds them as columns. An object,
    not a closure, so a deep copy or a pickle of the model follows its own host; ``host`` is held weakly, as
    :class:`Whole`'s owner."""

    def __init__(self, host: nn.Module, name: str, a: int = 0, b: int = 0, *,
                 interleaved: tuple[int, int, int] | None = None) -> None:
        self._host, self.name, self.a, self.b, self.interleaved = HostRef(host), name, a, b, interleaved
        self.what = (f"{name}[{a}:{b}]" if interleaved is None
                     else f"{name} ({'qkv'[interleaved[2]]} rows of each head)")

    @property
    def host(self) -> nn.Module:
        """The module holding the fused projection (``ReferenceError`` once it was freed)."""
        return self._host.get()

    def module(self) -> nn.Module:
        return getattr(self.host, self.name)

    def beyond_view(self) -> str:
        """Why calling the fused module computes more than its rows' ``F.linear`` (what :meth:`view` computes; ""
        where it does not): an adapter wrapping it (its delta is not in the base weight), a forward set on the
        instance, its own forward hooks, or a class other than ``nn.Linear`` / ``Conv1D``. The module's forward
        calls the fused module; a view of its rows cannot, so a caller computing with the view refuses these."""
        from transformers.pytorch_utils import Conv1D

        m = self.module()
        kind = f"{type(m).__module__}.{type(m).__qualname__}"
        if adapter_base(m) is not None:
            return (f"its fused {self.name} is wrapped by an adapter ({kind}), whose delta is not in the base weight "
                    "the layer's Q/K/V rows read (merge_and_unload() first)")
        if "forward" in vars(m):
            return f"its fused {self.name} has a forward set on the instance, which the layer's Q/K/V rows skip"
        if has_own_forward_hooks(m):
            return f"its fused {self.name} has forward hooks, which the layer's Q/K/V rows skip"
        if type(m) not in (nn.Linear, Conv1D):
            return f"its fused {self.name} is a {kind}, not an nn.Linear or Conv1D whose rows the layer can apply"
        return ""

    def _rows(self, t: torch.Tensor, conv: bool) -> torch.Tensor:
        """This projection's part of the fused weight (as ``(out, in)``) or bias."""
        if conv and t.dim() == 2:
            t = t.T  # (out, in)
        if self.interleaved is None:
            return t[self.a:self.b]
        h, d_h, j = self.interleaved
        return t.unflatten(0, (h, 3, d_h))[:, j].flatten(0, 1)  # (h * d_h, ...)

    def weight(self) -> torch.Tensor:
        m = _unpacked(self.module(), self.what)
        return self._rows(m.weight, is_conv1d(m))

    def bias(self) -> torch.Tensor | None:
        t = _unpacked(self.module(), self.what).bias
        return None if t is None else self._rows(t, False)

    def write(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._check_writable()
        m = self.module()
        for dst, src, what in ((m.weight, weight, "weight"), (m.bias, bias, "bias")):
            if dst is None:
                continue
            full = dst.T if is_conv1d(m) and dst.dim() == 2 else dst  # (out, in) view of the storage
            if self.interleaved is None:
                _copy(full[self.a:self.b], src, f"{self.what}.{what}")
            else:
                h, d_h, j = self.interleaved
                _copy(full.unflatten(0, (h, 3, d_h))[:, j], src.unflatten(0, (h, d_h)), f"{self.what}.{what}")


@dataclass
class Located:
    """A module's heads and projections (see :func:`locate`).

    Attributes:
        d, h, h_kv, d_v: model width, query heads, key/value heads, value head width.
        where: ``{q_proj, k_proj, v_proj, out_proj: Projection or the reason it is not located}``.
        layout: ``"split"``, ``"blocks"``, ``"per_head"`` or ``"kv_blocks"`` (Q in its own projection, K | V fused:
            a cross-attention module, registry ``cross_q``) (how Q/K/V are held; ``"split"`` when not located).
        fused: the fused Q/K/V module's name, or None.
        entry: the family's registry entry.
    """

    d: int
    h: int
    h_kv: int
    d_v: int
    where: dict[str, Projection | str]
    layout: str
    fused: str | None
    entry: Entry

    def why(self, names: tuple[str, ...] = PROJECTIONS) -> str:
        """The first reason one of ``names`` is not located ("" when all are)."""
        return next((w for n in names if isinstance(w := self.where[n], str)), "")


def _count(owners: tuple[Any, ...], names: tuple[str, ...]) -> int | None:
    for owner in owners:
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _find(owner: nn.Module, names: tuple[str, ...]) -> tuple[str, nn.Module] | tuple[None, None]:
    """The first of ``names`` below ``owner`` that is a projection (``nn.Linear`` or ``Conv1D``)."""
    for name in names:
        try:
            found = owner.get_submodule(name)
        except AttributeError:
            continue
        if projection_size(found) is not None:
            return name, found
    return None, None


def _sizes(module: nn.Module, entry: Entry) -> tuple[int, int, int, int]:
    """(d, h, h_kv, d_v) from the module's attributes, then its config."""
    cfg = module.config
    owners = (module, cfg)
    h = _count(owners, entry.heads)
    if h is None:
        raise ValueError(f"{type(module).__name__}: cannot find its number of heads (looked for {entry.heads} on "
                         "the module and its config); add an entry to headwise.interop.hf.registry")
    d = _count(owners, entry.width)
    d_v = _count(owners, entry.d_v) or (d // h if d else None)
    if d_v is None:
        raise ValueError(f"{type(module).__name__}: cannot find its head width (looked for {entry.d_v})")
    h_kv = _count((module,), entry.kv_heads) or _kv_from_weights(module, entry, h, d_v)
    groups = _count((module,), ("num_key_value_groups",))
    if h_kv is None:
        h_kv = h // groups if groups else (_count((cfg,), entry.kv_heads) or h)
    return d or h * d_v, h, h_kv, d_v


def is_cross(module: nn.Module, entry: Entry) -> bool:
    """Whether ``module`` is a cross-attention module whose queries live apart from its fused K | V
    (:attr:`~headwise.interop.hf.registry.Entry.cross_q`)."""
    return entry.cross_q is not None and entry.qkv is not None and getattr(module, "is_cross_attention", False) is True


def _kv_from_weights(module: nn.Module, entry: Entry, h: int, d_v: int) -> int | None:
    """K/V heads from the key projection's width (configs may carry a num_key_value_heads a family ignores)."""
    if entry.unlocated:
        return None
    if entry.qkv is not None:
        size = projection_size(getattr(module, entry.qkv, None))
        rest = size[0] - (0 if is_cross(module, entry) else h * d_v) if size else 0
        return rest // (2 * d_v) if rest > 0 and rest % (2 * d_v) == 0 else None
    _, k = _find(module, entry.k)
    out = projection_size(k)[0] if k is not None else 0
    return out // d_v if out and out % d_v == 0 else None


def _locate_qkv(module: nn.Module, entry: Entry, h: int, h_kv: int, d_v: int) -> dict[str, Projection] | str:
    owner = type(module).__name__
    if entry.unlocated:
        return entry.unlocated
    if is_cross(module, entry):
        return _locate_cross(module, entry, h, h_kv, d_v)
    if entry.qkv is not None:
        name, want = entry.qkv, (h + 2 * h_kv) * d_v
        size = projection_size(getattr(module, name, None))
        if size is None and (packed := _packed_at(module, (name,))):
            return packed
        if size is None or size[0] != want:
            got = size[0] if size else type(getattr(module, name, None)).__name__
            return f"{owner}.{name} is not a projection with (h + 2 h_kv) d_h = {want} outputs (got {got})"
        if entry.layout == "blocks":
            q, k = h * d_v, (h + h_kv) * d_v
            return {"q_proj": Rows(module, name, 0, q), "k_proj": Rows(module, name, q, k),
                    "v_proj": Rows(module, name, k, want)}
        if h_kv != h:
            return f"{owner}.{name}: a head-interleaved Q/K/V layout needs h_kv == h, got {h_kv} and {h}"
        return {p: Rows(module, name, interleaved=(h, d_v, j)) for j, p in enumerate(("q_proj", "k_proj", "v_proj"))}
    found = {hw: _find(module, names) for hw, names in (("q_proj", entry.q), ("k_proj", entry.k),
                                                        ("v_proj", entry.v))}
    missing = [hw for hw, (name, _) in found.items() if name is None]
    if missing:
        names = entry.q + entry.k + entry.v
        return _packed_at(module, names) or f"{owner} has no projection named {' / '.join(names)} for {missing}"
    want = {"q_proj": h * d_v, "k_proj": h_kv * d_v, "v_proj": h_kv * d_v}
    got = {hw: projection_size(m)[0] for hw, (_, m) in found.items()}
    if got != want:
        return f"{owner}: the projections have {got} outputs, h={h}, h_kv={h_kv}, d_h={d_v} need {want}"
    if len({m.bias is None for _, m in found.values()}) != 1:
        return f"{owner}: some of {', '.join(n for n, _ in found.values())} have a bias and some do not"
    return {hw: Whole(module, name) for hw, (name, _) in found.items()}


def _locate_cross(module: nn.Module, entry: Entry, h: int, h_kv: int, d_v: int) -> dict[str, Projection] | str:
    """Q from ``entry.cross_q``, K | V as blocks of ``entry.qkv`` (GPT-2's cross-attention)."""
    owner, name, kv = type(module).__name__, entry.qkv, h_kv * d_v
    q_name, q = _find(module, (entry.cross_q,))
    fused = getattr(module, name, None)
    size = projection_size(fused)
    if q is None or projection_size(q)[0] != h * d_v:
        got = projection_size(q)[0] if q is not None else "none"
        return f"{owner}.{entry.cross_q} is not a query projection with h d_h = {h * d_v} outputs (got {got})"
    if size is None or size[0] != 2 * kv:
        got = size[0] if size else type(fused).__name__
        return f"{owner}.{name} is not a K | V projection with 2 h_kv d_h = {2 * kv} outputs (got {got})"
    if (q.bias is None) != (fused.bias is None):
        return f"{owner}: one of {entry.cross_q}, {name} has a bias and the other does not"
    return {"q_proj": Whole(module, q_name), "k_proj": Rows(module, name, 0, kv),
            "v_proj": Rows(module, name, kv, 2 * kv)}


def _locate_o(module: nn.Module, parent: nn.Module | None, entry: Entry, d: int, inner: int) -> Projection | str:
    for owner, names in ((module, entry.o), (parent, entry.o_parent)):
        if owner is None:
            continue
        name, o = _find(owner, names)
        if o is not None and projection_size(o) == (d, inner):
            return Whole(owner, name)
        if o is None and (packed := _packed_at(owner, names)):
            return packed
    where = f"{entry.o} on {type(module).__name__}" + (f" or {entry.o_parent} on {type(parent).__name__}"
                                                      if parent is not None else
                                                      f" (or {entry.o_parent} on its parent, not given)")
    return f"no projection ({d}, {inner}) named {where}"


def locate(module: nn.Module, parent: nn.Module | None, entry: Entry) -> Located:
    """The heads and projections of ``module`` (``parent``: its enclosing module, for W_O found there).

    Raises ``ValueError`` only when the head counts cannot be found; a projection that is not located carries its
    reason instead.

    Shapes:
        module (d, h, h_kv, d_v) -> Located(d, h, h_kv, d_v)
    """
    d, h, h_kv, d_v = _sizes(module, entry)
    qkv = _locate_qkv(module, entry, h, h_kv, d_v)
    where: dict[str, Projection | str] = {}
    for hw in ("q_proj", "k_proj", "v_proj"):
        where[hw] = qkv[hw] if isinstance(qkv, dict) else f"Q/K/V are not located: {qkv}"
    o = _locate_o(module, parent, entry, d, h * d_v)
    where["out_proj"] = o if isinstance(o, Projection) else f"W_O is not located: {o}"
    layout = entry.layout if isinstance(qkv, dict) and entry.qkv is not None else "split"
    if layout != "split" and is_cross(module, entry):
        layout = "kv_blocks"  # Q apart, K | V fused
    return Located(d, h, h_kv, d_v, where, layout, entry.qkv if layout != "split" else None, entry)
