"""BERT self-attention (``BertAttention`` = ``BertSelfAttention`` + ``BertSelfOutput``) <-> headwise.

In Hugging Face, BERT's attention is split over two modules: ``BertAttention.self`` (a
``BertSelfAttention``: W_Q, W_K, W_V and the softmax) returns the concatenated heads *before* W_O, and
``BertAttention.output`` (a ``BertSelfOutput``) applies ``dense`` (= W_O), dropout, and
``LayerNorm(x + residual)``. A :class:`MultiHeadAttention` covers exactly Q/K/V + softmax + W_O, so the
unit converted here is the ``BertAttention``:

==================================  ==============  ==============================
Hugging Face                        headwise        note
==================================  ==============  ==============================
``BertAttention.self.query``        ``q_proj``      ``(h * d_h, d)``
``BertAttention.self.key``          ``k_proj``      ``(h * d_h, d)``
``BertAttention.self.value``        ``v_proj``      ``(h * d_h, d)``
``BertAttention.output.dense``      ``out_proj``    ``(d, h * d_h)``
``BertAttention.self.scaling``      ``config.scale``
``BertAttention.output.LayerNorm``  (not part)      stays in ``BertSelfOutput``
==================================  ==============  ==============================

:func:`headwise.interop.patch` turns ``BertAttention.self`` into a patched module (same object, same
``query``/``key``/``value``) that computes the heads' context with headwise and returns it *before* W_O, as
HF's does; ``BertSelfOutput`` still applies ``dense``, dropout and LayerNorm. The layer (a
:class:`BertView`) reads ``self.query/key/value`` and the sibling ``output.dense`` live, so
``attn(x)`` and ``attn.head(i).w_o`` use W_O although the patched forward does not. Cross-attention
(``BertCrossAttention`` in BERT decoders) is not converted.

Shapes:
    b: batch, s: sequence, h: heads, d: model width (hidden_size), d_h: head width.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import functional as hwf
from ..attention import MultiHeadAttention
from ..config import AttentionConfig
from ._hf_common import HeadwiseHFModule, check_linear, check_same, copy_into, hf_attend, new_copy, pop_cache, qkv_bias
from ._view import LayerView
from .hf_seam import SurgerySeam, linear_like, set_counts

__all__ = ["classes", "from_module", "load_into", "BertView", "PatchedBertSelf"]

KEY = "bert"
NAME = "BERT (BertAttention: .self query/key/value + .output.dense)"


def classes() -> tuple[type, ...]:
    from transformers.models.bert.modeling_bert import BertAttention

    return (BertAttention,)


def self_attention_classes() -> tuple[type, type]:
    from transformers.models.bert.modeling_bert import BertCrossAttention, BertSelfAttention

    return BertSelfAttention, BertCrossAttention


def is_cross(module: nn.Module) -> bool:
    _, cross = self_attention_classes()
    return bool(getattr(module, "is_cross_attention", False)) or isinstance(getattr(module, "self", None), cross)


def config_of(module: nn.Module) -> AttentionConfig:
    """The :class:`AttentionConfig` of a ``BertAttention``, every projection shape checked.

    Shapes:
        self.query / self.key / self.value (h * d_h, d), output.dense (d, h * d_h)
    """
    owner = type(module).__name__
    if isinstance(module.self, HeadwiseHFModule):
        raise TypeError(f"{owner}.self is already patched by headwise; use {owner}.self.attn (a MultiHeadAttention) "
                        "or unpatch the model first")
    if is_cross(module):
        raise NotImplementedError(f"{owner} is a cross-attention block (BertCrossAttention); headwise.interop "
                                  "converts BERT self-attention only")
    sa = module.self
    d, h, d_h = sa.config.hidden_size, sa.num_attention_heads, sa.attention_head_size
    q = check_linear(owner, "self.query", sa.query, h * d_h, d)
    k = check_linear(owner, "self.key", sa.key, h * d_h, d)
    v = check_linear(owner, "self.value", sa.value, h * d_h, d)
    o = check_linear(owner, "output.dense", module.output.dense, d, h * d_h)
    return AttentionConfig(d_model=d, n_heads=h, d_head=d_h, bias=qkv_bias(owner, q, k, v),
                           out_bias=o.bias is not None, dropout=float(sa.dropout.p), scale=float(sa.scaling))


_NAMES = {"q_proj": "self.query", "k_proj": "self.key", "v_proj": "self.value", "out_proj": "output.dense"}


def _pairs(module: nn.Module) -> dict[str, nn.Linear]:
    return {hw: module.get_submodule(path) for hw, path in _NAMES.items()}


def from_module(module: nn.Module, *, share: bool = False, rotary_emb: nn.Module | None = None) -> MultiHeadAttention:
    """Convert one ``BertAttention``: a standalone copy, or (``share=True``) a :class:`BertView` of it.

    Shapes:
        BertAttention (d, h, d_h) -> MultiHeadAttention(d, h, d_head=d_h)
    """
    cfg = config_of(module)
    backend = "eager" if getattr(module.self.config, "_attn_implementation", None) == "eager" else "sdpa"
    if share:
        return BertView.build(cfg, module.self, backend=backend, _hw_owner=module)
    return new_copy(cfg, {k: (m.weight, m.bias) for k, m in _pairs(module).items()}, rotary=None, backend=backend,
                    like=module.self.query.weight, training=module.training)


def load_into(module: nn.Module, attn: MultiHeadAttention) -> None:
    """Write ``attn``'s weights into a ``BertAttention`` of the same shape (in place).

    Shapes:
        attn.q/k/v_proj -> self.query/key/value, attn.out_proj -> output.dense, same (out, in)
    """
    owner = type(module).__name__
    check_same(owner, config_of(module), attn.config)
    for hw_name, dst in _pairs(module).items():
        src = getattr(attn, hw_name)
        copy_into(dst.weight, src.weight, f"{owner}.{_NAMES[hw_name]}.weight")
        if dst.bias is not None:
            copy_into(dst.bias, src.bias, f"{owner}.{_NAMES[hw_name]}.bias")


def host_of(module: nn.Module) -> tuple[nn.Module, str]:
    """The module :func:`patch` turns into a headwise one, and its path below ``module``."""
    return module.self, ".self"


def is_target(module: nn.Module) -> bool:
    """A ``BertAttention`` that :func:`patch` should take over (self-attention, not yet patched)."""
    return (isinstance(module, classes()) and not is_cross(module)
            and not isinstance(module.self, HeadwiseHFModule))


class BertView(SurgerySeam, LayerView):
    """The headwise layer of a patched ``BertSelfAttention``: ``query``/``key``/``value`` of the host and the
    sibling ``BertSelfOutput.dense`` (W_O) of the enclosing ``BertAttention``, resolved live.

    Shapes:
        as :class:`MultiHeadAttention`(d, h)
    """

    _hw_owner: nn.Module

    def resolve(self, name: str) -> nn.Module:
        return self._hw_owner.get_submodule(_NAMES[name])

    def assign(self, name: str, value: Any) -> None:
        parent, _, attr = _NAMES[name].rpartition(".")
        setattr(self._hw_owner.get_submodule(parent), attr, value)

    def sources(self) -> list[tuple[str, nn.Module]]:
        return [(hw, self.resolve(hw)) for hw in _NAMES]

    def source_names(self) -> dict[str, str]:
        return {hw: path.replace("self.", "") if path.startswith("self.") else f"(BertAttention).{path}"
                for hw, path in _NAMES.items()}

    def write_heads(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]], n_heads: int,
                    n_kv_heads: int, heads_from: Any = None) -> None:
        """New ``query``/``key``/``value`` and sibling ``output.dense`` holding ``weights`` (the surgery seam,
        :mod:`~headwise.interop.hf_seam`), and the ``num_attention_heads`` / ``all_head_size`` the forward reads.

        Shapes:
            q/k/v_proj (h * d_h, d), out_proj (d, h * d_h)
        """
        self.refuse_edit(n_heads, n_kv_heads)
        for hw, path in _NAMES.items():
            w, b = weights[hw]
            self.assign(hw, linear_like(w, b, self._hw_owner.get_submodule(path)))
        set_counts(self._hw_host, self.surgery_entry(), n_heads, n_kv_heads, self.d_head)


class PatchedBertSelf:
    """Forward of a patched ``BertSelfAttention``: HF's signature and return (the heads' context, before W_O).

    Shapes:
        hidden_states: (b, s, d); attention_mask: (b, 1, s, s_kv) or None
        -> (b, s, h * d_h), weights (b, h, s, s_kv) or None
    """

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, cache: Any = None,
                **kwargs: Any):
        cache = pop_cache(cache, kwargs)
        kwargs.pop("encoder_hidden_states", None)  # BertAttention always passes it; self-attention ignores it
        q, k, v = self.attn.project_qkv(hidden_states)  # (b, h, s, d_h) each
        if cache is not None:
            current = getattr(cache, "self_attention_cache", cache)  # EncoderDecoderCache in BERT decoders
            k, v = current.update(k, v, self.layer_idx, kwargs=kwargs)
        out, weights = hf_attend(self, q, k, v, attention_mask, kwargs)
        return hwf.merge_heads(out), weights  # (b, s, h * d_h): BertSelfOutput applies W_O
