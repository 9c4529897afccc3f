"""What :func:`headwise.check` reads off a Hugging Face attention module before running it: which module attends
(:func:`attention_of`), its sliding window, whether it is cross-attention, the keywords its forward takes, the
scale and softcap its family declares (:func:`declared`), and the relative position bias the T5 family adds to its
scores (:func:`relative_bias`).

Families are recognised the one way headwise recognises them: a module whose forward calls transformers'
attention interface, read through its registry entry (:mod:`headwise.interop.hf.registry`). ``transformers`` is
imported only when such a module is checked.

Shapes:
    b: batch, s: tokens, d: model width, h: query heads, d_qk: query/key head width.
    relative_bias: (1, h, s, s).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from torch import nn

__all__ = ["hf_class", "attention_of", "chunk_of", "cross_reason", "keywords", "folded_scale",
           "t5_style", "relative_bias", "declared", "CACHE_KW", "MASK_KW", "SUPPLIED"]

CACHE_KW = ("cache", "past_key_values", "past_key_value", "layer_past")
# The keyword the forward takes its 4-D mask by, in the form the model's mask function builds: T5's family
# (T5, mT5, LongT5, SwitchTransformers, Pop2Piano, UDOP, Pix2Struct) calls it ``mask``
MASK_KW = ("attention_mask", "mask")
_CROSS_KW = ("key_value_states", "encoder_hidden_states")
SUPPLIED = {*MASK_KW, "position_embeddings", "position_ids", "cache_position", *CACHE_KW}


def hf_class(module: Any) -> type | None:
    """The first Hugging Face class of ``module``'s class hierarchy, or None when it is not a transformers
    module."""
    return next((c for c in type(module).__mro__ if c.__module__.startswith("transformers.")), None)


def attention_of(module: Any) -> nn.Module | None:
    """The module that calls transformers' attention interface: ``module`` itself, or the one such child of a block
    that also holds its W_O (BERT's ``BertAttention``); None when ``module`` is neither."""
    if not isinstance(module, nn.Module) or hf_class(module) is None:
        return None
    from ..interop.hf.layer import is_target

    if is_target(module):
        return module
    inner = [child for child in module.children() if is_target(child)]
    return inner[0] if len(inner) == 1 else None


def chunk_of(module: nn.Module, config: Any) -> int | None:
    """The chunk of the model's chunked causal mask for this layer (Llama 4: a query reads only the keys of its own
    ``attention_chunk_size`` chunk), or None: ``config.layer_types`` says ``"chunked_attention"`` for it, or, with no
    layer types, the config sets a chunk size (the cache then treats every layer as chunked)."""
    chunk = getattr(config, "attention_chunk_size", None)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
        return None
    types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if isinstance(types, (list, tuple)):
        return chunk if isinstance(index, int) and index < len(types) and types[index] == "chunked_attention" \
            else None
    return chunk


def cross_reason(module: nn.Module, params: set[str], where: str, causal: bool | None) -> str:
    """Why ``module`` is cross-attention ("" when it is not): it says so, or its name in the model does; a module
    without a name that takes another sequence's keys, belongs to a decoder and is not causal is BART's
    ``encoder_attn`` unless the caller claims causality (BigBird-Pegasus's decoder self-attention says
    ``is_causal=False``)."""
    if getattr(module, "is_cross_attention", False) is True:
        return "its is_cross_attention is True"
    if where:
        return "by its name in the model" if "cross" in where or "encoder_attn" in where else ""
    if causal is None and params & set(_CROSS_KW) and getattr(module, "is_decoder", None) is True \
            and getattr(module, "is_causal", None) is False:
        return ("a decoder's module that takes key_value_states and is not causal, as BART's encoder_attn; pass "
                "causal=True if it is a decoder's self-attention, or check the view from headwise.interop.layers")
    return ""


def keywords(module: nn.Module) -> set[str]:
    """The keywords the module's forward takes; ``TypeError`` for a required one the check cannot build."""
    params = list(inspect.signature(module.forward).parameters.values())
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = [p.name for p in params[1:] if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in SUPPLIED]
    if required:
        raise TypeError(f"{type(module).__name__}.forward needs {required}, which headwise.check cannot build; "
                        f"it supplies hidden_states and {sorted(SUPPLIED)}")
    return named


def folded_scale(q: torch.Tensor, outs: list[torch.Tensor]) -> float:
    """The factor between the q the interface got and the projection that made it, where the module multiplied
    one by a constant: each (token, head) row of q has the norm of that head's rows of some projection's output
    (its first h * d_qk columns) times the same factor (rotary rotates, so norms survive it; a per-head norm would
    not keep one factor). 1.0 when no projection is related so.

    Shapes: q (b, h, s, d_qk); outs: projection outputs (b, s, >= h * d_qk)"""
    b, h, s, d = q.shape
    q_norm = q.detach().double().norm(dim=-1)  # (b, h, s)
    for out in outs:
        if out.dim() != 3 or tuple(out.shape[:2]) != (b, s) or out.shape[-1] < h * d:
            continue
        rows = out[..., :h * d].detach().double().reshape(b, s, h, d).transpose(1, 2)  # (b, h, s, d_qk)
        ratio = q_norm / rows.norm(dim=-1).clamp_min(1e-300)
        factor = float(ratio.mean())
        if factor > 0 and float((ratio / factor - 1).abs().max()) < 1e-4:
            return 1.0 if abs(factor - 1) < 1e-4 else factor
    return 1.0


def t5_style(module: Any) -> bool:
    """Attention of the T5 family (T5, mT5, UMT5, LongT5, SwitchTransformers, Pop2Piano, UDOP, Pix2Struct): its
    scores are q . k unscaled plus a relative position bias, which a layer with ``has_relative_attention_bias``
    computes itself (``compute_bias``) and every other layer of the stack is handed."""
    return isinstance(module, nn.Module) and isinstance(getattr(module, "relative_attention_num_buckets", None), int) \
        and callable(getattr(module, "compute_bias", None))


def relative_bias(module: Any, s: int) -> torch.Tensor | None:
    """The relative position bias a T5-style layer that holds one adds to the scores of ``s`` tokens over
    themselves, or None (another layer, or a T5 layer without its own bias: run alone it adds zeros).

    Shapes: -> (1, h, s, s)"""
    if not t5_style(module) or getattr(module, "has_relative_attention_bias", False) is not True:
        return None
    with torch.no_grad():
        bias = module.compute_bias(s, s)
    return bias if isinstance(bias, torch.Tensor) and bias.dim() == 4 and tuple(bias.shape[-2:]) == (s, s) else None


def _positive(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    return float(value) if ok else None


def _gpt2_scale(module: nn.Module, config: Any) -> tuple[float | None, str]:
    """GPT-2's ``scale_attn_by_inverse_layer_idx=True`` (GPT-2, ImageGPT, Decision Transformer): layer i scales its
    scores by 1/sqrt(d_qk) / (i + 1); (None, "") otherwise. ``scale_attn_weights=False`` (no scale at all) is not
    honoured: an unscaled layer is what the scale check is there to catch."""
    index, d_qk = getattr(module, "layer_idx", None), getattr(module, "head_dim", None)
    if getattr(config, "scale_attn_by_inverse_layer_idx", None) is not True or not isinstance(index, int) \
            or not isinstance(d_qk, int) or d_qk <= 0:
        return None, ""
    scale = d_qk ** -0.5 / (index + 1)
    return scale, f"1/sqrt({d_qk}) / (layer_idx + 1) (scale_attn_by_inverse_layer_idx, layer {index})"


def _yarn_scale(module: nn.Module, config: Any) -> tuple[float | None, str]:
    """Multi-head latent attention under YaRN (DeepSeek-V2/V3 and the families built like them): the family's own
    ``yarn_apply_mscale`` multiplies 1/sqrt(qk_head_dim) by mscale**2 from ``config.rope_parameters``
    (``mscale_all_dim``); (None, "") where the family has no such function or it leaves the scale as it was."""
    family = hf_class(module)
    apply = None if family is None else getattr(sys.modules.get(family.__module__), "yarn_apply_mscale", None)
    d_qk, params = getattr(module, "qk_head_dim", None), getattr(config, "rope_parameters", None)
    if not callable(apply) or not isinstance(d_qk, int) or d_qk <= 0 or not isinstance(params, dict):
        return None, ""
    scale = _positive(apply(params, d_qk ** -0.5))
    if scale is None or abs(scale * d_qk ** 0.5 - 1) < 1e-12:
        return None, ""
    return scale, f"1/sqrt({d_qk}) * mscale**2 = {scale:g} (yarn_apply_mscale of the config's rope_parameters)"


def declared(module: nn.Module, config: Any) -> tuple[float | None, str, float | None]:
    """``(scale, where it is declared, softcap)`` as the family declares them in its config (the registry's
    ``scale_fields``: ``query_pre_attn_scalar ** -0.5`` for Gemma 2 and 3; ``multiplier_fields``: Granite's
    ``attention_multiplier``; GPT-2's ``scale_attn_by_inverse_layer_idx``; DeepSeek's YaRN ``mscale_all_dim``;
    ``softcap_fields``: Gemma 2's ``attn_logit_softcapping``; the T5 family's scores are not scaled (1)), or
    ``(None, "", None)``: the check then expects ``1/sqrt(d_qk)`` and no softcap. The module's own ``scaling`` is
    what is checked, never what it is checked against."""
    from ..interop.hf.layer import family_entry

    if t5_style(module):  # T5 scales nothing: its relative position bias takes the place of the scale
        return 1.0, "1 (the T5 family does not scale its scores)", None
    entry = family_entry(module)
    scale, where = None, ""
    for name in entry.scale_fields:
        value = _positive(getattr(config, name, None))
        if value is not None:
            scale, where = value ** -0.5, f"{name}**-0.5 = {value:g}**-0.5 (the config's)"
            break
    for name in entry.multiplier_fields if scale is None else ():
        value = _positive(getattr(config, name, None))
        if value is not None:
            scale, where = value, f"{name} = {value:g} (the config's)"
            break
    if scale is None:
        scale, where = _gpt2_scale(module, config)
    if scale is None:
        scale, where = _yarn_scale(module, config)
    softcap = next((v for n in entry.softcap_fields if (v := _positive(getattr(config, n, None))) is not None), None)
    return scale, where, softcap
