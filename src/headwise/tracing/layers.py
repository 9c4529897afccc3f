"""The layers a trace addresses (:func:`find_layers`), an encoder-decoder's encoder (:func:`encoder_modules`) and
every head's write (:func:`head_results`).

Shapes:
    b: batch, s: sequence, h: query heads, d: model width, d_h: head width.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..attention import MultiHeadAttention
from ..stored_weights import packed_weight
from ..module_calls import adapter_base

__all__ = ["find_layers", "in_place", "encoder_modules", "head_results", "w_o_adapter"]


def find_layers(module: nn.Module) -> list[tuple[str, MultiHeadAttention]]:
    """``(name, layer)`` of every headwise layer in ``module``, in model order.

    A bare :class:`MultiHeadAttention` is its own only layer (name ``""``); a model patched by
    :func:`headwise.interop.patch` lists what :func:`headwise.interop.layers` lists (named by the Hugging Face
    module); any other module lists its :class:`MultiHeadAttention` submodules by ``named_modules`` name.

    Shapes:
        each layer: MultiHeadAttention(d, h, h_kv, d_h)

    Example:
        >>> import torch, headwise
        >>> model = torch.nn.Sequential(headwise.MultiHeadAttention(8, 2), torch.nn.ReLU())
        >>> [name for name, _ in find_layers(model)]
        ['0']
    """
    if isinstance(module, MultiHeadAttention):
        return [("", module)]
    if not isinstance(module, nn.Module):
        raise TypeError(f"trace: module must be a MultiHeadAttention or a torch.nn.Module containing them, "
                        f"got {type(module).__name__}")
    found = []
    # Only a transformers model (or a module holding one, which means interop is already imported) can be
    # patched; importing interop, and so transformers, for anything else would cost seconds.
    if type(module).__module__.startswith("transformers.") or "headwise.interop" in sys.modules:
        try:
            from ..interop import layers as patched_layers

            found = list(patched_layers(module))
        except ImportError:  # pragma: no cover - an interop without its optional peer
            found = []
    bypassed = [why for _, layer in found if (why := getattr(layer, "bypassed", lambda: "")())]
    if bypassed:
        raise ValueError(f"trace: {bypassed[0]}")
    if not found:
        found = [(n, m) for n, m in module.named_modules() if isinstance(m, MultiHeadAttention)]
    if not found:
        raise TypeError(f"trace: {type(module).__name__} contains no MultiHeadAttention (patch a Hugging Face "
                        "model first with headwise.interop.patch)")
    return found


def in_place(module: nn.Module, name: str, layer: MultiHeadAttention) -> bool:
    """Whether ``layer`` is still the layer :func:`find_layers` named ``name`` in ``module``: the submodule there,
    or the layer a patch gave it (``.attn``). It walks one path, not the whole model, and ``torch.compile``
    traces it (a traced model's forward asks it at every call).

    Example:
        >>> import headwise
        >>> model = torch.nn.Sequential(headwise.MultiHeadAttention(8, 2))
        >>> in_place(model, "0", model[0]), in_place(model, "0", headwise.MultiHeadAttention(8, 2))
        (True, False)
    """
    try:
        here = module.get_submodule(name)
    except AttributeError:  # the path itself is gone
        return False
    return here is layer or getattr(here, "attn", None) is layer


def encoder_modules(model: nn.Module) -> set[str] | None:
    """The names of the modules inside an encoder-decoder model's encoder (``config.is_encoder_decoder``): empty
    for any other model, None for one without a ``get_encoder()`` module (where its encoder is is unknown).

    Example:
        >>> import headwise
        >>> encoder_modules(torch.nn.Sequential(headwise.MultiHeadAttention(8, 2)))
        set()
    """
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return set()
    encoder = model.get_encoder() if callable(getattr(model, "get_encoder", None)) else None
    if not isinstance(encoder, nn.Module):
        return None
    inside = {id(m) for m in encoder.modules()}
    return {name for name, m in model.named_modules() if id(m) in inside}


def head_results(z: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """Each head's write through W_O, ``z_h @ W_O^h`` (its write into the residual stream unless the model
    normalises the attention output before the residual add, as Gemma2 does), as h GEMMs (one ``bmm``).

    Shapes:
        z: (b, h, s, d_h); w_o: (d, h * d_h) (``out_proj.weight``) -> (b, s, h, d)

    Example:
        >>> z, w = torch.randn(2, 3, 4, 5), torch.randn(6, 15)
        >>> torch.testing.assert_close(head_results(z, w).sum(2), z.transpose(1, 2).reshape(2, 4, 15) @ w.T)
    """
    b, h, s, d_h = z.shape
    d = w_o.shape[0]
    per_head = w_o.reshape(d, h, d_h).permute(1, 2, 0).to(z.dtype)  # (h, d_h, d): W_O^h
    rows = z.transpose(0, 1).reshape(h, b * s, d_h)  # (h, b * s, d_h)
    return torch.bmm(rows, per_head).view(h, b, s, d).permute(1, 2, 0, 3)  # (b, s, h, d)


def w_o_adapter(layer: MultiHeadAttention) -> nn.Module | None:
    """The adapter (a PEFT tuner layer, which keeps the layer it wraps as ``base_layer``) wrapping ``layer``'s
    W_O, or None. Its delta is not in ``out_proj.weight``, so per-head writes computed from that weight would not
    be the layer's output. A patched layer's W_O may hide behind a projection view (GPT-2's ``Conv1D``): its
    ``sources()`` name the module itself.

    Raises ``TypeError`` where W_O holds a packed (quantized) weight: no per-head write can be read off it.

    Example:
        >>> import headwise
        >>> w_o_adapter(headwise.MultiHeadAttention(8, 2)) is None
        True
    """
    modules = [layer.out_proj]
    sources = getattr(layer, "sources", None)
    if callable(sources):
        modules += [m for name, m in sources() if name == "out_proj"]
    if packed := next((why for m in modules if (why := packed_weight(m))), ""):
        where = getattr(layer, "host_name", "")
        raise TypeError(f"{where + ': ' if where else ''}each head's write through W_O is read off its float "
                        f"weight, but out_proj is {packed}")
    return next((m for m in modules if adapter_base(m) is not None), None)
