"""A :class:`MultiHeadAttention` that owns nothing: a live window onto another module's projections.

Interop uses it to run headwise on a Hugging Face or ``nn.MultiheadAttention`` module *without* copying
or renaming anything. ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` are class-level properties that
resolve, on every access, to the host's *current* modules (so a PEFT LoRA wrapper put on the host's
``q_proj`` after patching is what the layer runs) or to light projection views of fused weights
(:class:`ProjectionView`). The layer is never registered as a submodule of the host, so the host's
``state_dict``, ``named_modules`` and ``parameters`` are exactly what they were; the layer's own
``parameters()``/``children()``/``.to()``/``.train()`` reach the host's modules (see
:meth:`LayerView.sources`), and its ``state_dict`` refuses (save the host's).

A patched module holds its view, so the view holds the module weakly (:class:`HostRef`): a strong reference back
would make a cycle that only Python's cyclic collector frees, and ``del model`` would not give back the model's
memory (GPU memory included) until it ran. A view used after its model was freed raises ``ReferenceError``.

Shapes:
    b: batch, s: sequence, h: query heads, h_kv: key/value heads, d: model width, d_h: head width.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from ..attention import MultiHeadAttention
from ..config import AttentionConfig
from ..head import ORIGINAL_HEADS

__all__ = ["HostRef", "LayerView", "ProjectionView", "host_of"]

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


class HostRef:
    """A view's (or a projection locator's) reference to the module whose weights it reads: weak, since that module
    holds the view (``keep=True`` holds it strongly too, where the view is what keeps it: ``from_torch(share=True)``).

    ``ref()`` gives the module or None (a plain ``weakref.ref``: a C call, no Python frame on hot paths, and one
    ``torch.compile`` traces); :meth:`get` gives the module or raises ``ReferenceError`` naming it. A deep copy
    refers to the module's copy (the copy's own, through the memo; a module outside what is copied is copied and
    held strongly), and a pickle carries the module itself and loads it held strongly (a view pickled alone is
    the only holder of its module), so a copied or loaded model's views read the copy's weights.

    Args:
        host: the module.
        what: how errors name it (its class and, where known, its qualified name).
        keep: hold ``host`` strongly as well.
    """

    __slots__ = ("ref", "what", "_keep")

    def __init__(self, host: Any, what: str = "", keep: bool = False) -> None:
        self.ref = weakref.ref(host)
        self.what = what or type(host).__name__
        self._keep = host if keep else None

    def get(self) -> Any:
        """The module; ``ReferenceError`` if it was freed."""
        host = self.ref()
        if host is None:
            raise ReferenceError(
                f"the module {self.what} no longer exists (the model it belonged to was freed): a headwise view does "
                "not keep its model alive, so keep a reference to the model while using its layers and heads, or take "
                "a standalone copy first (headwise.interop.from_hf / from_torch)")
        return host

    def __copy__(self) -> "HostRef":
        return self

    def __deepcopy__(self, memo: dict) -> "HostRef":
        host = self.ref()
        if host is None:
            return self  # nothing to follow: the copy reads nothing either
        copied = memo.get(id(host))
        if copied is None:  # the module is not part of what is copied (a view copied alone): the copy holds its own
            return type(self)(copy.deepcopy(host, memo), self.what, keep=True)
        return type(self)(copied, self.what, keep=self._keep is not None)

    def __reduce__(self) -> tuple:
        # Loaded strongly: a view pickled alone (not as part of its module) is the only holder of the module it
        # brings along, as for a deep copy of a view alone. A whole model loaded from a pickle then keeps the
        # module <-> view cycle (freed by the cyclic collector, as any pickle does not say which it was).
        return type(self), (self.get(), self.what, True)

    def __repr__(self) -> str:
        return f"HostRef({self.what}{'' if self.ref() is not None else ', freed'})"


def host_of(layer: Any) -> Any:
    """The module ``layer`` is a view of; None where ``layer`` is no view (or not built yet) or that module was
    freed."""
    ref = getattr(layer, "__dict__", {}).get("_hw_host")
    return None if ref is None else ref.ref()


class ProjectionView:
    """A callable with ``.weight`` (out, in) and ``.bias``, both views of someone else's parameters.

    ``weight()`` and ``bias()`` are called on every access, so the view follows the owner's current
    tensors (after ``.to()``, ``load_state_dict(assign=True)`` or a PEFT wrapper). Calling it computes
    ``x @ weight.T + bias``, or ``call(x)`` when given (e.g. the host module itself).

    Shapes:
        weight: (out, in); bias: (out,) or None; x (b, s, in) -> (b, s, out)
    """

    def __init__(self, weight: Callable[[], torch.Tensor], bias: Callable[[], torch.Tensor | None],
                 call: Callable[[torch.Tensor], torch.Tensor] | None = None, what: str = "") -> None:
        self._weight, self._bias, self._call, self.what = weight, bias, call, what

    @property
    def weight(self) -> torch.Tensor:
        return self._weight()

    @property
    def bias(self) -> torch.Tensor | None:
        return self._bias()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._call is not None:
            return self._call(x)
        return F.linear(x, self.weight, self.bias)

    def __repr__(self) -> str:
        return f"ProjectionView({self.what})"


def _live(name: str) -> property:
    def get(self: "LayerView") -> Any:
        if self.__dict__.get("_hw_host") is None:  # under construction: the core's own modules
            return self._modules[name]
        return self.resolve(name)

    def set_(self: "LayerView", value: Any) -> None:
        self.assign(name, value)

    return property(get, set_, doc=f"``{name}`` of the host module, resolved on every access.")


def _live_training() -> property:
    def get(self: "LayerView") -> bool:
        ref = self.__dict__.get("_hw_host")
        if ref is None:
            return self.__dict__.get("_hw_training", True)
        host = ref.ref()  # a C call: this is read on every attend
        return (ref.get() if host is None else host).training

    def set_(self: "LayerView", mode: bool) -> None:
        ref = self.__dict__.get("_hw_host")
        if ref is None:
            self.__dict__["_hw_training"] = mode
        else:
            ref.get().training = mode

    return property(get, set_, doc="The host's train/eval flag (dropout follows the host).")


class LayerView(MultiHeadAttention):
    """Base of every view layer; a subclass says where the projections live.

    Subclasses implement :meth:`resolve` (headwise name -> the host's current callable), :meth:`sources`
    (the host modules the view reads, for ``parameters()`` and friends) and may override :meth:`assign`
    and the forward steps (``project_qkv`` for a fused QKV GEMM).
    """

    q_proj = _live("q_proj")
    k_proj = _live("k_proj")
    v_proj = _live("v_proj")
    out_proj = _live("out_proj")
    training = _live_training()

    @classmethod
    def build(cls, config: AttentionConfig, host: nn.Module, *, backend: str, name: str = "", keep: bool = False,
              **extra: Any) -> "LayerView":
        """A view of ``host`` with ``config``; nothing is allocated (the core builds on the meta device and
        the placeholders are dropped) and no data is read.

        Args:
            config: the layer's config.
            host: the module whose weights it reads.
            backend: the core's backend.
            name: the host's qualified name in its model ("" if unknown).
            keep: hold ``host`` strongly (where nothing else does); else weakly, as a module holding its view needs
                (:class:`HostRef`).
            extra: further attributes, set as references (never registered submodules).
        """
        self = cls.from_config(config, backend=backend, device="meta")
        for proj in PROJECTIONS:
            if proj in self._modules:
                delattr(self, proj)  # the core's meta placeholders; the properties serve the host's modules
        for key, value in extra.items():
            object.__setattr__(self, key, value)  # references, never registered submodules
        object.__setattr__(self, "_hw_name", name)
        what = f"{type(host).__name__}" + (f" at {name!r}" if name else "")
        object.__setattr__(self, "_hw_host", HostRef(host, what, keep=keep))
        return self

    @property
    def host(self) -> nn.Module:
        """The module whose weights this layer computes with (``ReferenceError`` once it was freed)."""
        return self._hw_host.get()

    @property
    def host_name(self) -> str:
        """The host's qualified name in the model :func:`~headwise.interop.patch` patched ("" if none given)."""
        return self._hw_name

    def resolve(self, name: str) -> Any:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def assign(self, name: str, value: Any) -> None:
        raise TypeError(f"{type(self).__name__}.{name} is a view of {type(self.host).__name__}'s weights; "
                        "replace the module on the host instead")

    def sources(self) -> list[tuple[str, nn.Module]]:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def __setattr__(self, name: str, value: Any) -> None:
        # nn.Module.__setattr__ would register a module under a property's name (bypassing the property).
        if name in PROJECTIONS and self.__dict__.get("_hw_host") is not None:
            self.assign(name, value)
        else:
            super().__setattr__(name, value)

    # -- the forward: self-attention projects Q, K, V in one call ---------------------------------------
    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V of every head from one input. Shapes: x (b, s, d) -> (b, h, s, d_h), (b, h_kv, s, d_h) x2."""
        k, v = self.project_kv(x)
        return self.project_q(x), k, v

    @classmethod
    def from_heads(cls, heads: Any, **kwargs: Any) -> MultiHeadAttention:
        """Heads packed into a standalone :class:`~headwise.MultiHeadAttention` (see its ``from_heads``): a view
        needs a host module, and packed heads have none.

        Args:
            heads, kwargs: as :meth:`MultiHeadAttention.from_heads`.
        """
        return MultiHeadAttention.from_heads(heads, **kwargs)

    # -- module protocol: the host's modules are this layer's children ---------------------------------
    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        seen: set[int] = set()
        for name, module in self.sources():
            if id(module) not in seen:
                seen.add(id(module))
                yield name, module

    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True):
        memo = set() if memo is None else memo
        if self not in memo:
            if remove_duplicate:
                memo.add(self)
            yield prefix, self
            for name, module in self.named_children():
                yield from module.named_modules(memo, f"{prefix}.{name}" if prefix else name, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{type(self).__name__} is a view of {self._hw_name or type(self.host).__name__}: its "
                        "weights are the host's; save the host model's state_dict (it keeps its own names), or "
                        "take a standalone copy with from_hf / from_torch")

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{type(self).__name__} is a view: load weights into the host model instead")

    def extra_repr(self) -> str:
        if self._hw_host.ref() is None:  # a repr never raises: say what it was a view of
            return f"view of {self._hw_host.what}, freed"
        kind = type(self.host).__name__
        names = ", ".join(f"{hw}={what}" for hw, what in self.source_names().items())
        origin = self.host.__dict__.get(ORIGINAL_HEADS)  # after head surgery: which original heads these are
        return (f"view of {self._hw_name or kind} ({kind}: {names}), {super().extra_repr()}"
                + ("" if origin is None else f", original heads {list(origin)}"))

    def source_names(self) -> dict[str, str]:
        """headwise name -> where it lives on the host (for ``repr``)."""
        return {name: name for name in PROJECTIONS}

