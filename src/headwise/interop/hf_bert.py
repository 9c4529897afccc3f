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

:func:`headwise.interop.patch` replaces ``BertAttention.self`` by a patched module that ends with
``attn.project_out`` (so its output is already through W_O) and sets ``BertAttention.output.dense`` to
``nn.Identity`` (the same ``nn.Linear`` now lives at ``attn.out_proj``); dropout and LayerNorm still run
in ``BertSelfOutput``. Cross-attention (``BertCrossAttention`` in BERT decoders) is not converted.

Shapes:
    b: batch, s: sequence, h: heads, d: model width (hidden_size), d_h: head width.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention import MultiHeadAttention
from ..config import AttentionConfig
from ._hf_common import (HeadwiseHFModule, check_linear, check_same, copy_into, hf_attend, new_attention,
                         patched_class, pop_cache, qkv_bias)

__all__ = ["classes", "from_module", "load_into", "PatchedBertSelf"]

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


def _pairs(module: nn.Module) -> dict[str, nn.Linear]:
    sa = module.self
    return {"q_proj": sa.query, "k_proj": sa.key, "v_proj": sa.value, "out_proj": module.output.dense}


def from_module(module: nn.Module, *, share: bool = False, rotary_emb: nn.Module | None = None) -> MultiHeadAttention:
    """Convert (copy, or with ``share=True`` reuse the ``nn.Linear`` modules of) one ``BertAttention``.

    Shapes:
        BertAttention (d, h, d_h) -> MultiHeadAttention(d, h, d_head=d_h)
    """
    cfg = config_of(module)
    backend = "eager" if getattr(module.self.config, "_attn_implementation", None) == "eager" else "sdpa"
    pairs = _pairs(module)
    common = {"rotary": None, "backend": backend, "like": module.self.query.weight, "training": module.training}
    if share:
        return new_attention(cfg, share=pairs, **common)
    return new_attention(cfg, copy={k: (m.weight, m.bias) for k, m in pairs.items()}, **common)


def load_into(module: nn.Module, attn: MultiHeadAttention) -> None:
    """Write ``attn``'s weights into a ``BertAttention`` of the same shape (in place).

    Shapes:
        attn.q/k/v_proj -> self.query/key/value, attn.out_proj -> output.dense, same (out, in)
    """
    owner = type(module).__name__
    check_same(owner, config_of(module), attn.config)
    names = {"q_proj": "self.query", "k_proj": "self.key", "v_proj": "self.value", "out_proj": "output.dense"}
    for hw_name, dst in _pairs(module).items():
        src = getattr(attn, hw_name)
        copy_into(dst.weight, src.weight, f"{owner}.{names[hw_name]}.weight")
        if dst.bias is not None:
            copy_into(dst.bias, src.bias, f"{owner}.{names[hw_name]}.bias")


def is_target(module: nn.Module) -> bool:
    """A ``BertAttention`` that :func:`patch` should take over (self-attention, not yet patched)."""
    return (isinstance(module, classes()) and not is_cross(module)
            and not isinstance(module.self, HeadwiseHFModule))


def patch_one(model: nn.Module, name: str, module: nn.Module, mixin: type) -> nn.Module:
    """Replace ``module.self`` (and ``module.output.dense`` by Identity); return the patched ``self``."""
    attn = from_module(module, share=True)
    restore = [(module, "self", module.self), (module.output, "dense", module.output.dense)]
    patched = patched_class(mixin, type(module.self))(module.self, attn, restore)
    module.self = patched
    module.output.dense = nn.Identity()
    return patched


class PatchedBertSelf:
    """Forward of a patched ``BertSelfAttention``: HF's signature, but the output is already through W_O.

    Shapes:
        hidden_states: (b, s, d); attention_mask: (b, 1, s, s_kv) or None
        -> (b, s, d), weights (b, h, s, s_kv) or None
    """

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, cache: Any = None,
                **kwargs: Any):
        cache = pop_cache(cache, kwargs)
        kwargs.pop("encoder_hidden_states", None)  # BertAttention always passes it; self-attention ignores it
        attn = self.attn
        q = attn.project_q(hidden_states)  # (b, h, s, d_h)
        k, v = attn.project_kv(hidden_states)  # (b, h, s, d_h)
        if cache is not None:
            current = getattr(cache, "self_attention_cache", cache)  # EncoderDecoderCache in BERT decoders
            k, v = current.update(k, v, self.layer_idx, kwargs=kwargs)
        out, weights = hf_attend(self, q, k, v, attention_mask, kwargs)
        return attn.project_out(out), weights
