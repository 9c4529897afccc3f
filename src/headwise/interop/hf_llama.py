"""Llama-style attention (``LlamaAttention``, ``MistralAttention``, ``Qwen2Attention``) <-> headwise.

Name map (one attention module -> one :class:`MultiHeadAttention`):

=====================  ======================  ============================================
Hugging Face           headwise                note
=====================  ======================  ============================================
``q_proj``             ``q_proj``              ``(h * d_h, d)``
``k_proj``             ``k_proj``              ``(h_kv * d_h, d)``; GQA/MQA via num_key_value_heads
``v_proj``             ``v_proj``              ``(h_kv * d_h, d)``
``o_proj``             ``out_proj``            ``(d, h * d_h)``
``scaling``            ``config.scale``        copied exactly (not recomputed)
rotary (model-level)   ``rotary``              :class:`RotaryEmbedding` from ``rope_parameters``
=====================  ======================  ============================================

Shapes:
    b: batch, s: sequence, h: query heads, h_kv: key/value heads, d: model width, d_h: head width.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention import MultiHeadAttention
from ..config import AttentionConfig
from ..rotary import RotaryEmbedding, apply_rotary
from ._hf_common import (check_linear, check_same, copy_into, hf_attend, new_attention, pop_cache, qkv_bias,
                         replace_in_parent)

__all__ = ["classes", "from_module", "load_into", "rotary_from_hf", "PatchedLlamaStyle"]

NAME = "Llama-family (LlamaAttention, MistralAttention, Qwen2Attention)"


def classes() -> tuple[type, ...]:
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.mistral.modeling_mistral import MistralAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    return (LlamaAttention, MistralAttention, Qwen2Attention)


def rotary_classes() -> tuple[type, ...]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    return (LlamaRotaryEmbedding, MistralRotaryEmbedding, Qwen2RotaryEmbedding)


def rotary_from_hf(config: Any, d_head: int, rotary_emb: nn.Module | None = None) -> RotaryEmbedding:
    """A :class:`RotaryEmbedding` equal to the model's.

    ``rope_type == "default"`` is rebuilt from ``rope_theta`` (bit-identical to HF's ``inv_freq``). Any other
    type (linear, dynamic, yarn, llama3, longrope, ...) takes ``inv_freq`` and ``attention_scaling`` from
    ``rotary_emb`` (the model's ``rotary_emb`` module; its ``original_inv_freq`` for dynamic variants) or,
    without one, from transformers' own ``ROPE_INIT_FUNCTIONS`` applied to ``config``. Variants whose
    frequencies change with sequence length at run time are frozen at their initial value here.

    Shapes:
        inv_freq: (rotary_dim // 2,), rotary_dim <= d_head
    """
    params = getattr(config, "rope_parameters", None) or {}
    if params and "rope_type" not in params and all(isinstance(v, dict) for v in params.values()):
        raise NotImplementedError(f"{type(config).__name__} has per-layer-type rope_parameters "
                                  f"({sorted(params)}); headwise supports one rotary embedding per model")
    rope_type = params.get("rope_type", "default")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if rope_type == "default" and rotary_emb is None:
        if theta is None:
            raise ValueError(f"{type(config).__name__} has no rope_theta in rope_parameters={params}")
        return RotaryEmbedding(d_head, base=float(theta))
    if rotary_emb is not None:
        inv_freq = getattr(rotary_emb, "original_inv_freq", None)
        inv_freq = rotary_emb.inv_freq if inv_freq is None else inv_freq
        scaling = float(getattr(rotary_emb, "attention_scaling", 1.0))
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise NotImplementedError(f"rope_type={rope_type!r} is unknown to this transformers; known: "
                                      f"{sorted(ROPE_INIT_FUNCTIONS)} and 'default'")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    inv_freq = inv_freq.detach().float().cpu()
    return RotaryEmbedding(d_head, base=float(theta or 10000.0), rotary_dim=2 * inv_freq.numel(),
                           inv_freq=inv_freq, attention_scaling=float(scaling))


def _sizes(module: nn.Module) -> tuple[str, int, int, int, int]:
    cfg = module.config
    owner = type(module).__name__
    return owner, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, module.head_dim


def config_of(module: nn.Module) -> AttentionConfig:
    """The :class:`AttentionConfig` of a Llama-style attention module, every projection shape checked.

    Shapes:
        q_proj (h * d_h, d), k_proj / v_proj (h_kv * d_h, d), o_proj (d, h * d_h)
    """
    owner, d, h, h_kv, d_h = _sizes(module)
    for name in ("q_norm", "k_norm"):
        if isinstance(getattr(module, name, None), nn.Module):
            raise NotImplementedError(f"{owner} normalises Q/K per head ({name}); headwise does not model it")
    q = check_linear(owner, "q_proj", module.q_proj, h * d_h, d)
    k = check_linear(owner, "k_proj", module.k_proj, h_kv * d_h, d)
    v = check_linear(owner, "v_proj", module.v_proj, h_kv * d_h, d)
    o = check_linear(owner, "o_proj", module.o_proj, d, h * d_h)
    return AttentionConfig(d_model=d, n_heads=h, n_kv_heads=h_kv, d_head=d_h, bias=qkv_bias(owner, q, k, v),
                           out_bias=o.bias is not None, dropout=float(module.attention_dropout),
                           scale=float(module.scaling))


def _backend(module: nn.Module) -> str:
    return "eager" if getattr(module.config, "_attn_implementation", None) == "eager" else "sdpa"


def from_module(module: nn.Module, *, share: bool = False, rotary_emb: nn.Module | None = None) -> MultiHeadAttention:
    """Convert (copy, or with ``share=True`` reuse the ``nn.Linear`` modules of) one attention module.

    Shapes:
        module (d, h, h_kv, d_h) -> MultiHeadAttention(d, h, h_kv, d_head=d_h, rotary=RotaryEmbedding(d_h))
    """
    cfg = config_of(module)
    rotary = rotary_from_hf(module.config, cfg.d_head, rotary_emb)
    pairs = {"q_proj": module.q_proj, "k_proj": module.k_proj, "v_proj": module.v_proj, "out_proj": module.o_proj}
    common = {"rotary": rotary, "backend": _backend(module), "like": module.q_proj.weight,
              "training": module.training}
    if share:
        return new_attention(cfg, share=pairs, **common)
    return new_attention(cfg, copy={k: (m.weight, m.bias) for k, m in pairs.items()}, **common)


def is_target(module: nn.Module) -> bool:
    """A Llama-style attention module that :func:`patch` should take over."""
    return isinstance(module, classes())


def rotary_module_for(model: nn.Module, name: str) -> nn.Module | None:
    """The model's rotary module serving the attention at ``name`` (the deepest one whose owner contains it)."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, rotary_classes())]
    owners = [(n.rpartition(".")[0], m) for n, m in found]
    inside = [(o, m) for o, m in owners if o == "" or name == o or name.startswith(o + ".")]
    if inside:
        return max(inside, key=lambda om: len(om[0]))[1]
    return found[0][1] if len(found) == 1 else None


def patch_one(model: nn.Module, name: str, module: nn.Module, mixin: type) -> nn.Module:
    attn = from_module(module, share=True, rotary_emb=rotary_module_for(model, name))
    return replace_in_parent(model, name, module, attn, mixin)


def load_into(module: nn.Module, attn: MultiHeadAttention) -> None:
    """Write ``attn``'s weights into a Llama-style module of the same shape (in place).

    Shapes:
        attn.q_proj -> q_proj, attn.k_proj -> k_proj, attn.v_proj -> v_proj, attn.out_proj -> o_proj, same (out, in)
    """
    owner = type(module).__name__
    cfg = config_of(module)
    check_same(owner, cfg, attn.config)
    for hf_name, hw_name in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("o_proj", "out_proj")):
        dst, src = getattr(module, hf_name), getattr(attn, hw_name)
        copy_into(dst.weight, src.weight, f"{owner}.{hf_name}.weight")
        if dst.bias is not None:
            copy_into(dst.bias, src.bias, f"{owner}.{hf_name}.bias")


class PatchedLlamaStyle:
    """Forward of a patched Llama/Mistral/Qwen2 attention: same signature and return as HF's.

    Shapes:
        hidden_states: (b, s, d); position_embeddings: cos, sin (b or 1, s, d_h)
        -> (b, s, d), weights (b, h, s, s_kv) or None
    """

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, cache: Any = None, **kwargs: Any):
        cache = pop_cache(cache, kwargs)
        attn = self.attn
        q = attn.project_q(hidden_states)  # (b, h, s, d_h)
        k, v = attn.project_kv(hidden_states)  # (b, h_kv, s, d_h)
        if position_embeddings is not None:
            cos, sin = (t.unsqueeze(1) for t in position_embeddings)  # (b or 1, 1, s, d_h)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        else:
            positions = kwargs.get("position_ids")
            if positions is None:
                offset = cache.get_seq_length(self.layer_idx) if cache is not None else 0
                positions = torch.arange(offset, offset + hidden_states.shape[1], device=hidden_states.device)
            q, k = attn.rotary.rotate(q, k, positions)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        out, weights = hf_attend(self, q, k, v, attention_mask, kwargs)
        return attn.project_out(out), weights
