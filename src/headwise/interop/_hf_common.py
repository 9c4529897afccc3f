"""Pieces shared by the Hugging Face families: weight checks, the patched-module base, mask handling.

Hugging Face models hand their attention modules an ``attention_mask`` that is already prepared for the
model's ``attn_implementation``; this module passes it to :meth:`MultiHeadAttention.attend` unchanged,
because both conventions agree with headwise's (see :func:`hf_attend`).

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width (d_model), d_h: head width (d_head).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import nn

from ..attention import MultiHeadAttention
from ..config import AttentionConfig
from ..rotary import RotaryEmbedding

__all__ = ["HeadwiseHFModule", "hf_attend", "check_linear", "new_copy", "patched_class", "patch_in_place",
           "unpatch_in_place", "SUPPORTED_IMPLS"]

SUPPORTED_IMPLS = ("eager", "sdpa", "headwise")


def check_linear(owner: str, name: str, layer: object, out_features: int, in_features: int) -> nn.Linear:
    """``layer`` must be an ``nn.Linear`` whose weight is ``(out, in)`` and bias ``(out,)`` or None."""
    if not isinstance(layer, nn.Linear):
        if isinstance(getattr(layer, "base_layer", None), nn.Module):  # a PEFT adapter wrapping the projection
            raise TypeError(f"{owner}.{name} is wrapped by PEFT ({type(layer).__module__}.{type(layer).__name__}); "
                            "patch the model before get_peft_model, or merge_and_unload() it first")
        raise TypeError(f"{owner}.{name} must be an nn.Linear, got {type(layer).__name__}")
    got = tuple(layer.weight.shape)
    if got != (out_features, in_features):
        raise ValueError(f"{owner}.{name}.weight must have shape (out={out_features}, in={in_features}), got {got}")
    if layer.bias is not None and tuple(layer.bias.shape) != (out_features,):
        raise ValueError(f"{owner}.{name}.bias must have shape ({out_features},), got {tuple(layer.bias.shape)}")
    return layer


def qkv_bias(owner: str, *layers: nn.Module) -> bool:
    """Whether Q, K, V carry biases; headwise has one flag for the three, so a mix is unsupported."""
    present = {layer.bias is not None for layer in layers}
    if len(present) != 1:
        raise NotImplementedError(f"{owner}: some of the Q/K/V projections have a bias and some do not; "
                                  "headwise supports biases on all three or on none")
    return present.pop()


def check_same(owner: str, want: AttentionConfig, got: AttentionConfig) -> None:
    """``got`` (a MultiHeadAttention's config) must describe the same layer as ``want`` (the module's)."""
    fields = ("d_model", "n_heads", "n_kv_heads", "d_head", "bias", "out_bias", "kdim", "vdim")
    diff = {f: (getattr(want, f), getattr(got, f)) for f in fields if getattr(want, f) != getattr(got, f)}
    # 1/sqrt(d_h) and d_h ** -0.5 may differ in the last bit; anything more is a different layer.
    if not math.isclose(want.scale, got.scale, rel_tol=1e-6):
        diff["scale"] = (want.scale, got.scale)
    if diff:
        detail = ", ".join(f"{f}: module {a!r} vs attn {b!r}" for f, (a, b) in diff.items())
        raise ValueError(f"cannot write this MultiHeadAttention into {owner}: {detail}")


def copy_into(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """In-place copy that refuses a shape change (the HF module keeps its own layout)."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    if dst is src or (dst.data_ptr() == src.data_ptr() and dst.stride() == src.stride()):
        return  # shared storage (a patched model): nothing to copy
    with torch.no_grad():
        dst.copy_(src)


def check_impl(config: Any, where: str) -> str:
    """The model's attention implementation, if headwise can reproduce its masks; raise otherwise."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_IMPLS:
        raise ValueError(
            f"{where}: attn_implementation={impl!r} is not supported (its masks are not 4-D tensors); "
            f"supported: {SUPPORTED_IMPLS}. Load the model with attn_implementation='headwise', 'sdpa' or 'eager', "
            "or call model.set_attn_implementation('headwise') before patching"
        )
    return impl


def hf_attend(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              attention_mask: torch.Tensor | None, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention exactly as Hugging Face's eager / sdpa interfaces compute it, through ``module.attn.attend``.

    * A 4-D bool mask (sdpa) is True = may attend: headwise's convention, passed unchanged.
    * A 4-D float mask (eager) holds 0 / ``finfo.min``, added to the scores: passed unchanged, so rows
      whose keys are all masked become a uniform average, as in HF's eager path (never -inf, never NaN).
    * No mask: sdpa applies ``is_causal`` (module flag or ``is_causal=`` kwarg) only when ``s_q > 1``, top-left
      aligned; when ``s_kv > s_q`` it first crops K/V to ``s_q`` (the empty-static-cache prefill). Eager
      applies nothing: the mask is the only source of causality there.
    * Weights are returned where HF's eager would return them, and also under sdpa when
      ``output_attentions=True`` reaches the module (HF's sdpa returns None there).

    Shapes:
        q: (b, h, s_q, d_h); k, v: (b, h_kv, s_kv, d_h); attention_mask: (b or 1, 1, s_q, s_kv) or None
        -> (b, h, s_q, d_h), weights (b, h, s_q, s_kv) or None
    """
    impl = check_impl(module.config, type(module).__name__)
    causal = False
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
            got = (f"shape {tuple(attention_mask.shape)}" if isinstance(attention_mask, torch.Tensor)
                   else type(attention_mask).__name__)
            raise ValueError(f"{type(module).__name__} expects Hugging Face's prepared 4-D attention mask "
                             f"(b, 1, s_q, s_kv), bool or float; got {got}")
    elif impl in ("sdpa", "headwise"):  # "headwise" prepares sdpa's masks
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        s_q, s_kv = q.shape[2], k.shape[2]
        if is_causal and s_q > 1:
            if s_kv > s_q:
                k, v = k[:, :, :s_q], v[:, :, :s_q]  # (b, h_kv, s_q, d_h)
            causal = True
    want_weights = impl == "eager" or bool(kwargs.get("output_attentions", False))
    return module.attn.attend(q, k, v, mask=attention_mask, causal=causal, return_weights=want_weights)


def new_copy(cfg: AttentionConfig, weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]], *,
             rotary: RotaryEmbedding | None, backend: str, like: torch.Tensor, training: bool,
             cls: type = MultiHeadAttention, **extra: Any) -> MultiHeadAttention:
    """A standalone layer (its own parameters) holding copies of ``weights`` (``(weight (out, in), bias)``)."""
    attn = cls.from_config(cfg, rotary=rotary, backend=backend, device=like.device, dtype=like.dtype, **extra)
    with torch.no_grad():
        for name, (weight, bias) in weights.items():
            layer = getattr(attn, name)
            layer.weight.copy_(weight)
            if bias is not None:
                layer.bias.copy_(bias)
    if attn.rotary is not None:
        attn.rotary.to(like.device)
    return attn.train(training)  # a fresh module is in training mode: dropout must follow the HF module


class HeadwiseHFModule(nn.Module):
    """Marker base of every patched Hugging Face attention module (see :func:`patch_in_place`).

    :func:`headwise.interop.patch` does not replace the module: it changes its class, in place, to
    ``Headwise<Original>``, a subclass of ``(family mixin, HeadwiseHFModule, Original)`` whose ``forward``
    computes with :attr:`attn`. Every parameter, buffer, submodule, hook and attribute stays where it was,
    under its own name, so ``state_dict``, weight init, tensor-parallel plans and PEFT see the original.
    The headwise layer is kept out of the module tree (it is a view, never a registered submodule).

    Shapes:
        as the original module: hidden_states (b, s, d) -> (b, s, d), weights (b, h, s, s_kv) or None
    """

    @property
    def attn(self) -> MultiHeadAttention:
        """The headwise layer computing this module's attention: a view of this module's own weights."""
        return self.__dict__["_hw_attn"]

    @property
    def original_class(self) -> type:
        """The Hugging Face class this module had before patching (restored by ``unpatch``)."""
        return self.__dict__["_hw_class"]

    def extra_repr(self) -> str:
        base = self.__dict__["_hw_class"].extra_repr(self)
        attn = self.__dict__["_hw_attn"]
        own = (f"patched by headwise (was {self.__dict__['_hw_class'].__name__}): {type(attn).__name__}("
               f"{MultiHeadAttention.extra_repr(attn)})")
        return f"{base}, {own}" if base else own


_CLASSES: dict[tuple[type, type], type] = {}


def patched_class(mixin: type, base: type) -> type:
    """``Headwise<Base>``: the family ``mixin``'s forward over ``base`` (cached, one per pair).

    The class is also published in the mixin's module under its name, so pickle finds it by reference.
    """
    key = (mixin, base)
    if key not in _CLASSES:
        name = f"Headwise{base.__name__}"
        home = sys.modules[mixin.__module__]
        if getattr(home, name, None) is not None:  # two bases of one name (e.g. a remote-code copy)
            name = f"{name}_{len(_CLASSES)}"
        cls = type(name, (mixin, HeadwiseHFModule, base), {"__module__": mixin.__module__, "__qualname__": name})
        setattr(home, name, cls)
        _CLASSES[key] = cls
    return _CLASSES[key]


def patch_in_place(module: nn.Module, attn: MultiHeadAttention, mixin: type) -> nn.Module:
    """Turn ``module`` into its patched class (same object, same state) computing with ``attn``."""
    original = type(module)
    stash = module.__dict__.pop("forward", None)  # accelerate-style instance forward: it would run the original
    module.__class__ = patched_class(mixin, original)
    module.__dict__.update(_hw_attn=attn, _hw_class=original, _hw_forward=stash)
    return module


def unpatch_in_place(module: nn.Module) -> nn.Module:
    """Undo :func:`patch_in_place`: the original class and instance forward come back; nothing else moved."""
    state = module.__dict__
    module.__class__ = state.pop("_hw_class")
    state.pop("_hw_attn")
    stash = state.pop("_hw_forward")
    if stash is not None:
        state["forward"] = stash
    return module


def pop_cache(cache: Any, kwargs: dict) -> Any:
    """HF 5 renamed ``past_key_values`` to ``cache``; accept either name."""
    legacy = kwargs.pop("past_key_values", None)
    return legacy if cache is None else cache
