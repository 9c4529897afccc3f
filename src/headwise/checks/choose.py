"""Which adapter :func:`headwise.check` uses for a layer (:func:`adapt`).

The adapters themselves live in :mod:`.adapters` (generic, headwise, ``nn.MultiheadAttention``),
:mod:`.hf_adapters` (Hugging Face families, built on the generic ones) and :mod:`.hf_interface_adapter` (any
other Hugging Face module on transformers' attention interface, imported only when one is checked); this
module depends on them, none on it.

Shapes:
    layer: (b, s, d) -> (b, s, d).
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from .adapters import Adapter, CallableAdapter, ModuleAdapter, TorchMHAAdapter
from .hf_adapters import family_adapter, hf_adapter, hf_class

__all__ = ["adapt"]


def adapt(layer: Any, *, d_model: int | None = None, causal: bool | None = None) -> Adapter:
    """Pick the adapter for ``layer``: an :class:`Adapter` is used as is; headwise, torch and Hugging Face
    attention modules get theirs; any other module or callable gets the generic convention.

    ``causal=None`` means the layer's own claim (Hugging Face decoders: causal; everything else: not). A Hugging
    Face module with a family adapter (BERT, GPT-2, Llama-style) gets it; any other on the attention interface
    (patched or not, or its view from :func:`headwise.interop.layers`) gets the interface adapter.

    Shapes:
        layer: (b, s, d) -> (b, s, d).

    Example:
        >>> type(adapt(nn.MultiheadAttention(8, 2))).__name__
        'TorchMHAAdapter'
    """
    if isinstance(layer, Adapter):
        if causal is not None:
            layer.claims_causal = causal
        return layer
    if isinstance(layer, nn.MultiheadAttention):
        return TorchMHAAdapter(layer, causal=bool(causal))
    if isinstance(layer, nn.Module) and is_interface_view(layer):
        return interface_adapter(layer, causal=causal)
    if isinstance(layer, nn.Module) and hf_class(layer) is not None:
        if family_adapter(layer) is None and is_interface_module(layer):
            return interface_adapter(layer, causal=causal)
        return hf_adapter(layer, causal=causal)
    if isinstance(layer, nn.Module):
        return ModuleAdapter(layer, d_model=d_model, causal=bool(causal))
    if callable(layer):
        if d_model is None:
            raise ValueError("a plain callable needs d_model= (the width of x in f(x) with x (b, s, d_model))")
        return CallableAdapter(layer, d_model=d_model, causal=bool(causal))
    raise TypeError(f"layer must be an attention module or a callable f(x) -> y, got {type(layer).__name__}")


def is_interface_view(layer: nn.Module) -> bool:
    """The layer :func:`headwise.interop.layers` gives for a module on transformers' attention interface."""
    if "headwise.interop" not in sys.modules:  # nothing was patched: no such view exists
        return False
    from ..interop.hf_generic import InterfaceView

    return isinstance(layer, InterfaceView)


def is_interface_module(layer: nn.Module) -> bool:
    from .hf_interface_adapter import is_interface_module as on_interface

    return on_interface(layer)


def interface_adapter(layer: nn.Module, *, causal: bool | None) -> Adapter:
    from .hf_interface_adapter import InterfaceAdapter  # imports transformers' interface only when needed

    return InterfaceAdapter(layer, causal=causal)
