"""A :class:`MultiHeadAttention` that owns nothing: a live window onto another module's projections.

Interop uses it to run headwise on a Hugging Face or ``nn.MultiheadAttention`` module *without* copying
or renaming anything. ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` are class-level properties that
resolve, on every access, to the host's *current* modules (so a PEFT LoRA wrapper put on the host's
``q_proj`` after patching is what the layer runs) or to light projection views of fused weights
(:class:`ProjectionView`). The layer is never registered as a submodule of the host, so the host's
``state_dict``, ``named_modules`` and ``parameters`` are exactly what they were; the layer's own
``parameters()``/``children()``/``.to()``/``.train()`` reach the host's modules (see
:meth:`LayerView.sources`), and its ``state_dict`` refuses (save the host's).

Shapes:
    b: batch, s: sequence, h: query heads, h_kv: key/value heads, d: model width, d_h: head width.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from ..attention import MultiHeadAttention
from ..config import AttentionConfig
from ..head import ORIGINAL_HEADS

__all__ = ["LayerView", "ProjectionView"]

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


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
        host = self.__dict__.get("_hw_host")
        return self.__dict__.get("_hw_training", True) if host is None else host.training

    def set_(self: "LayerView", mode: bool) -> None:
        host = self.__dict__.get("_hw_host")
        if host is None:
            self.__dict__["_hw_training"] = mode
        else:
            host.training = mode

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
    def build(cls, config: AttentionConfig, host: nn.Module, *, backend: str, name: str = "",
              **extra: Any) -> "LayerView":
        """A view of ``host`` with ``config``; nothing is allocated (the core builds on the meta device and
        the placeholders are dropped) and no data is read."""
        self = cls.from_config(config, backend=backend, device="meta")
        for proj in PROJECTIONS:
            if proj in self._modules:
                delattr(self, proj)  # the core's meta placeholders; the properties serve the host's modules
        for key, value in extra.items():
            object.__setattr__(self, key, value)  # references, never registered submodules
        object.__setattr__(self, "_hw_name", name)
        object.__setattr__(self, "_hw_host", host)
        return self

    @property
    def host(self) -> nn.Module:
        """The module whose weights this layer computes with."""
        return self._hw_host

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
        kind = type(self.host).__name__
        names = ", ".join(f"{hw}={what}" for hw, what in self.source_names().items())
        origin = self.host.__dict__.get(ORIGINAL_HEADS)  # after head surgery: which original heads these are
        return (f"view of {self._hw_name or kind} ({kind}: {names}), {super().extra_repr()}"
                + ("" if origin is None else f", original heads {list(origin)}"))

    def source_names(self) -> dict[str, str]:
        """headwise name -> where it lives on the host (for ``repr``)."""
        return {name: name for name in PROJECTIONS}

