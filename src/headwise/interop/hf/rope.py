"""The model's rotary embedding as a :class:`~headwise.RotaryEmbedding`, for layers and heads run on their own.

A patched module rotates Q and K itself (the model hands it ``position_embeddings``); headwise needs its own
copy of the same rotation only where a layer or a head computes alone: ``attn(x)``, ``attn.head(i)(x)`` and
:func:`~headwise.interop.from_hf`'s copy, for families whose registry entry says ``rotary``.

Shapes:
    d_h: head width; inv_freq: (rotary_dim // 2,), rotary_dim <= d_h.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...rotary import RotaryEmbedding

__all__ = ["rotary_from_hf"]


def rotary_from_hf(config: Any, d_head: int, rotary_emb: nn.Module | None = None) -> RotaryEmbedding:
    """A :class:`RotaryEmbedding` equal to the model's, computed from ``config`` (no model data is read).

    ``rope_type == "default"`` is rebuilt from ``rope_theta`` (bit-identical to HF's ``inv_freq``); any other
    type (linear, dynamic, yarn, llama3, longrope, ...) takes ``inv_freq`` and ``attention_scaling`` from
    transformers' own ``ROPE_INIT_FUNCTIONS`` applied to ``config`` (what HF's weight init does), or from
    ``rotary_emb`` (the model's rotary module; its ``original_inv_freq`` for dynamic variants) when one is
    given whose buffers hold data; a ``rotary_emb`` of another width than the config gives is refused
    (``ValueError``). Variants whose model switches frequencies with the sequence length (dynamic NTK once a
    position reaches ``max_position_embeddings``, longrope once one reaches ``original_max_position_embeddings``)
    hold their initial ones and get that position as ``max_positions``: a standalone call reaching it raises
    ``ValueError`` (a patched model's own forward uses the model's rotary, live).

    Shapes:
        inv_freq: (rotary_dim // 2,), rotary_dim <= d_head

    Example:
        >>> import transformers
        >>> cfg = transformers.LlamaConfig(hidden_size=16, num_attention_heads=4)
        >>> rotary_from_hf(cfg, 4).inv_freq.tolist()
        [1.0, 0.009999999776482582]
    """
    params = getattr(config, "rope_parameters", None) or {}
    if params and "rope_type" not in params and all(isinstance(v, dict) for v in params.values()):
        raise NotImplementedError(f"{type(config).__name__} has per-layer-type rope_parameters "
                                  f"({sorted(params)}); headwise supports one rotary embedding per model")
    rope_type = params.get("rope_type", "default")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    inv_freq = None
    if rotary_emb is not None:
        inv_freq = getattr(rotary_emb, "original_inv_freq", None)
        inv_freq = getattr(rotary_emb, "inv_freq", None) if inv_freq is None else inv_freq
        if not isinstance(inv_freq, torch.Tensor):
            raise TypeError(f"rotary_emb must be the model's rotary module, whose inv_freq is a torch.Tensor; got "
                            f"{type(rotary_emb).__name__} with inv_freq {type(inv_freq).__module__}."
                            f"{type(inv_freq).__name__}")
        # the width transformers' rope init derives from the config: head width times partial_rotary_factor
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
        want = int(d_head * (1.0 if partial is None else partial))
        if 2 * inv_freq.numel() != want:
            raise ValueError(f"rotary_emb rotates {2 * inv_freq.numel()} features per head (2 * inv_freq.numel()), "
                             f"the config gives a rotary width of {want} (head width {d_head}): pass this model's "
                             "own rotary module")
        if inv_freq.is_meta:
            inv_freq = None  # not materialised yet: derive from the config instead
        else:
            scaling = float(getattr(rotary_emb, "attention_scaling", 1.0))
    if inv_freq is None and rope_type == "default":
        if theta is None:
            raise ValueError(f"{type(config).__name__} has no rope_theta in rope_parameters={params}")
        with torch.device("cpu"):  # real numbers even when called under a meta-device context
            return RotaryEmbedding(d_head, base=float(theta))
    if inv_freq is None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise NotImplementedError(f"rope_type={rope_type!r} is unknown to this transformers; known: "
                                      f"{sorted(ROPE_INIT_FUNCTIONS)} and 'default'")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device="cpu")
    inv_freq = inv_freq.detach().float().cpu()
    with torch.device("cpu"):
        return RotaryEmbedding(d_head, base=float(theta or 10000.0), rotary_dim=2 * inv_freq.numel(),
                               inv_freq=inv_freq, attention_scaling=float(scaling),
                               max_positions=_switch_position(config, params, rope_type), rope_type=rope_type)


def _switch_position(config: Any, params: dict, rope_type: str) -> int | None:
    """The first position at which transformers' rotary module swaps ``rope_type``'s initial frequencies for
    others (its ``dynamic_rope_update``: a sequence of length ``max(position) + 1`` past the limit), else None."""
    if "dynamic" in rope_type:  # recomputed once max(position) + 1 > max_position_embeddings
        limit = getattr(config, "max_position_embeddings", None)
    elif rope_type == "longrope":  # the long factor once max(position) + 1 > original_max_position_embeddings
        limit = params.get("original_max_position_embeddings",
                           getattr(config, "original_max_position_embeddings", None))
        limit = getattr(config, "max_position_embeddings", None) if limit is None else limit
    else:
        return None
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        raise ValueError(f"{type(config).__name__} with rope_type={rope_type!r} needs a positive int "
                         f"max_position_embeddings / original_max_position_embeddings, got {limit!r}")
    return limit
