"""Which adapter :func:`headwise.check` uses for a layer (:func:`adapt`).

The adapters themselves live in :mod:`.adapters` (generic, headwise), :mod:`.torch_mha` (``nn.MultiheadAttention``) and
:mod:`.hf_adapter` (every Hugging Face attention module on transformers' attention interface, imported only when
one is checked); this module depends on them, none on it.

Shapes:
    layer: (b, s, d) -> (b, s, d).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

from torch import nn

from .adapters import Adapter, CallableAdapter
from .module_adapter import ModuleAdapter
from .torch_mha import TorchMHAAdapter
from .hf_module import hf_class

__all__ = ["adapt"]


def adapt(layer: Any, *, d_model: int | None = None, causal: bool | None = None) -> Adapter:
    """Pick the adapter for ``layer``: an :class:`Adapter` is used as is; headwise, torch and Hugging Face
    attention modules get theirs; any other module or callable gets the generic convention.

    ``causal=None`` means the layer's own claim (Hugging Face decoders: causal; everything else: not). A Hugging
    Face module (patched or not, a block holding one, or its layer from :func:`headwise.interop.layers`) gets
    :class:`~headwise.checks.hf_adapter.HFAdapter`.

    Shapes:
        layer: (b, s, d) -> (b, s, d).

    Example:
        >>> type(adapt(nn.MultiheadAttention(8, 2))).__name__
        'TorchMHAAdapter'
    """
    if isinstance(layer, Adapter):
        if causal is not None and causal != layer.claims_causal:  # the caller's adapter keeps its own claim
            layer = copy.copy(layer)
            layer.claims_causal = causal
        return layer
    if isinstance(layer, nn.MultiheadAttention):
        return TorchMHAAdapter(layer, causal=bool(causal))
    if isinstance(layer, nn.Module) and (is_hf_view(layer) or hf_class(layer) is not None):
        from .hf_adapter import HFAdapter  # imports transformers' interface only when needed

        return HFAdapter(layer, causal=causal)
    if isinstance(layer, nn.Module):
        return ModuleAdapter(layer, d_model=d_model, causal=bool(causal))
    if callable(layer):
        if d_model is None:
            raise ValueError("a plain callable needs d_model= (the width of x in f(x) with x (b, s, d_model))")
        return CallableAdapter(layer, d_model=d_model, causal=bool(causal))
    raise TypeError(f"layer must be an attention module or a callable f(x) -> y, got {type(layer).__name__}")


def is_hf_view(layer: nn.Module) -> bool:
    """The layer :func:`headwise.interop.layers` gives for a Hugging Face module."""
    if "headwise.interop.hf" not in sys.modules:  # nothing was patched: no such view exists
        return False
    from ..interop.hf import HFView

    return isinstance(layer, HFView)
