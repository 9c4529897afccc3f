"""Llama-style attention (``LlamaAttention``, ``MistralAttention``, ``Qwen2Attention``, ``Qwen3Attention``)
<-> headwise.

Name map (one attention module -> one :class:`MultiHeadAttention`):

=====================  ======================  ============================================
Hugging Face           headwise                note
=====================  ======================  ============================================
``q_proj``             ``q_proj``              ``(h * d_h, d)``
``k_proj``             ``k_proj``              ``(h_kv * d_h, d)``; GQA/MQA via num_key_value_heads
``v_proj``             ``v_proj``              ``(h_kv * d_h, d)``
``o_proj``             ``out_proj``            ``(d, h * d_h)``
``q_norm`` / ``k_norm``  ``q_norm`` / ``k_norm``  Qwen3 only: RMSNorm over each head's d_h (QK-norm)
``scaling``            ``config.scale``        copied exactly (not recomputed)
rotary (model-level)   ``rotary``              :class:`RotaryEmbedding` from ``rope_parameters``
=====================  ======================  ============================================

A patched module's layer is a :class:`LlamaView`: its projections *are* the module's current ``q_proj`` ..
``o_proj`` (and norms), resolved on every call, and its ``rotary`` is derived from the config on first use
(so patching reads no data and works on the meta device).

Shapes:
    b: batch, s: sequence, h: query heads, h_kv: key/value heads, d: model width, d_h: head width.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..attention import MultiHeadAttention
from ..config import AttentionConfig
from ..rotary import RotaryEmbedding, apply_rotary
from ._hf_common import check_linear, check_same, copy_into, hf_attend, new_copy, pop_cache, qkv_bias
from ._view import LayerView
from .hf_seam import SurgerySeam, linear_like, set_counts
from .qk_norm import QKNormAttention, QKNormMixin

__all__ = ["classes", "from_module", "load_into", "rotary_from_hf", "LlamaView", "QKNormLlamaView",
           "PatchedLlamaStyle"]

KEY = "llama"
NAME = "Llama-family (LlamaAttention, MistralAttention, Qwen2Attention, Qwen3Attention with QK-norm)"


def classes() -> tuple[type, ...]:
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.mistral.modeling_mistral import MistralAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    return (LlamaAttention, MistralAttention, Qwen2Attention, Qwen3Attention)


def rotary_from_hf(config: Any, d_head: int, rotary_emb: nn.Module | None = None) -> RotaryEmbedding:
    """A :class:`RotaryEmbedding` equal to the model's, computed from ``config`` (no model data is read).

    ``rope_type == "default"`` is rebuilt from ``rope_theta`` (bit-identical to HF's ``inv_freq``); any other
    type (linear, dynamic, yarn, llama3, longrope, ...) takes ``inv_freq`` and ``attention_scaling`` from
    transformers' own ``ROPE_INIT_FUNCTIONS`` applied to ``config`` (what HF's weight init does), or from
    ``rotary_emb`` (the model's rotary module; its ``original_inv_freq`` for dynamic variants) when one is
    given whose buffers hold data. Variants whose frequencies change with sequence length at run time are
    frozen at their initial value here.

    Shapes:
        inv_freq: (rotary_dim // 2,), rotary_dim <= d_head
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
                               inv_freq=inv_freq, attention_scaling=float(scaling))


def _sizes(module: nn.Module) -> tuple[str, int, int, int, int]:
    cfg = module.config
    owner = type(module).__name__
    # A module resized by headwise.surgery records its own head counts (layers may differ from the config).
    h = getattr(module, "num_heads", cfg.num_attention_heads)
    return owner, cfg.hidden_size, h, getattr(module, "num_key_value_heads", cfg.num_key_value_heads), module.head_dim


def has_qk_norm(module: nn.Module) -> bool:
    return isinstance(getattr(module, "q_norm", None), nn.Module) or isinstance(getattr(module, "k_norm", None),
                                                                                  nn.Module)


def config_of(module: nn.Module) -> AttentionConfig:
    """The :class:`AttentionConfig` of a Llama-style attention module, every projection shape checked.

    Shapes:
        q_proj (h * d_h, d), k_proj / v_proj (h_kv * d_h, d), o_proj (d, h * d_h); q_norm / k_norm over d_h
    """
    owner, d, h, h_kv, d_h = _sizes(module)
    if has_qk_norm(module):
        for name in ("q_norm", "k_norm"):
            norm = getattr(module, name, None)
            if not isinstance(norm, nn.Module):
                raise NotImplementedError(f"{owner} has q_norm and k_norm only in part ({name} is "
                                          f"{type(norm).__name__}); headwise needs both or neither")
            weight = getattr(norm, "weight", None)
            if weight is not None and tuple(weight.shape) != (d_h,):
                raise ValueError(f"{owner}.{name} must normalise each head's d_h={d_h} features (weight ({d_h},)), "
                                 f"got weight {tuple(weight.shape)}")
    q = check_linear(owner, "q_proj", module.q_proj, h * d_h, d)
    k = check_linear(owner, "k_proj", module.k_proj, h_kv * d_h, d)
    v = check_linear(owner, "v_proj", module.v_proj, h_kv * d_h, d)
    o = check_linear(owner, "o_proj", module.o_proj, d, h * d_h)
    return AttentionConfig(d_model=d, n_heads=h, n_kv_heads=h_kv, d_head=d_h, bias=qkv_bias(owner, q, k, v),
                           out_bias=o.bias is not None, dropout=float(module.attention_dropout),
                           scale=float(module.scaling))


def _backend(module: nn.Module) -> str:
    return "eager" if getattr(module.config, "_attn_implementation", None) == "eager" else "sdpa"


_NAMES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "out_proj": "o_proj"}


def from_module(module: nn.Module, *, share: bool = False, rotary_emb: nn.Module | None = None) -> MultiHeadAttention:
    """Convert one attention module: a standalone copy, or (``share=True``) a :class:`LlamaView` of it.

    A module with QK-norm (Qwen3) gives a :class:`~headwise.interop.qk_norm.QKNormAttention` holding copies of
    its norms (or a :class:`QKNormLlamaView`).

    Shapes:
        module (d, h, h_kv, d_h) -> MultiHeadAttention(d, h, h_kv, d_head=d_h, rotary=RotaryEmbedding(d_h))
    """
    cfg = config_of(module)
    norm = has_qk_norm(module)
    if share:
        cls = QKNormLlamaView if norm else LlamaView
        return cls.build(cfg, module, backend=_backend(module))
    rotary = rotary_from_hf(module.config, cfg.d_head, rotary_emb)
    weights = {hw: (getattr(module, hf).weight, getattr(module, hf).bias) for hw, hf in _NAMES.items()}
    extra: dict[str, Any] = {}
    if norm:
        extra = {"cls": QKNormAttention, "q_norm": copy.deepcopy(module.q_norm), "k_norm": copy.deepcopy(module.k_norm)}
    return new_copy(cfg, weights, rotary=rotary, backend=_backend(module), like=module.q_proj.weight,
                    training=module.training, **extra)


def host_of(module: nn.Module) -> tuple[nn.Module, str]:
    """The module :func:`patch` turns into a headwise one (the module itself), and its path below it."""
    return module, ""


def is_target(module: nn.Module) -> bool:
    """A Llama-style attention module that :func:`patch` should take over."""
    return isinstance(module, classes())


def load_into(module: nn.Module, attn: MultiHeadAttention) -> None:
    """Write ``attn``'s weights (and Q/K norms) into a Llama-style module of the same shape (in place).

    Shapes:
        attn.q_proj -> q_proj, attn.k_proj -> k_proj, attn.v_proj -> v_proj, attn.out_proj -> o_proj, same (out, in)
    """
    owner = type(module).__name__
    cfg = config_of(module)
    check_same(owner, cfg, attn.config)
    norm = has_qk_norm(module)
    if norm != isinstance(attn, QKNormMixin):
        raise ValueError(f"cannot write this {type(attn).__name__} into {owner}: the module "
                         f"{'has' if norm else 'has no'} per-head q_norm/k_norm and the layer "
                         f"{'has' if isinstance(attn, QKNormMixin) else 'has none'}")
    for hw_name, hf_name in _NAMES.items():
        dst, src = getattr(module, hf_name), getattr(attn, hw_name)
        copy_into(dst.weight, src.weight, f"{owner}.{hf_name}.weight")
        if dst.bias is not None:
            copy_into(dst.bias, src.bias, f"{owner}.{hf_name}.bias")
    if norm:
        for name in ("q_norm", "k_norm"):
            dst, src = getattr(module, name), getattr(attn, name)
            want, got = dst.state_dict(), src.state_dict()
            if want.keys() != got.keys():
                raise ValueError(f"{owner}.{name} has {sorted(want)}, the layer's {name} has {sorted(got)}")
            for key in want:
                copy_into(want[key], got[key], f"{owner}.{name}.{key}")


class LlamaView(SurgerySeam, LayerView):
    """The headwise layer of a patched Llama/Mistral/Qwen2 module: a view of its ``q_proj`` .. ``o_proj``.

    Shapes:
        as :class:`MultiHeadAttention`; rotary: RotaryEmbedding(d_h) derived from the host's config
    """

    def resolve(self, name: str) -> nn.Module:
        return getattr(self._hw_host, _NAMES[name])

    def assign(self, name: str, value: Any) -> None:
        setattr(self._hw_host, _NAMES[name], value)

    def sources(self) -> list[tuple[str, nn.Module]]:
        return [(hw, getattr(self._hw_host, hf)) for hw, hf in _NAMES.items()]

    def source_names(self) -> dict[str, str]:
        return dict(_NAMES)

    def write_heads(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]], n_heads: int,
                    n_kv_heads: int, heads_from: Any = None) -> None:
        """New ``q_proj`` .. ``o_proj`` holding ``weights`` (the surgery seam, :mod:`~headwise.interop.hf_seam`),
        and the module's ``num_heads`` / ``num_key_value_heads`` / ``num_key_value_groups``.

        Shapes:
            q_proj (h * d_h, d), k_proj / v_proj (h_kv * d_h, d), out_proj (d, h * d_h)
        """
        self.refuse_edit(n_heads, n_kv_heads)
        host = self._hw_host
        for hw, hf in _NAMES.items():
            w, b = weights[hw]
            setattr(host, hf, linear_like(w, b, getattr(host, hf)))
        # _sizes reads num_heads / num_key_value_heads first: a resized module records its own counts.
        host.num_heads, host.num_key_value_heads = n_heads, n_kv_heads
        set_counts(host, self.surgery_entry(), n_heads, n_kv_heads, self.d_head)

    @property
    def rotary(self) -> RotaryEmbedding:
        """The model's rotary embedding as a :class:`RotaryEmbedding`, derived from its config on first use."""
        rotary = self.__dict__.get("_hw_rotary")
        if rotary is None:
            rotary = rotary_from_hf(self._hw_host.config, self.config.d_head)
            self.__dict__["_hw_rotary"] = rotary
        return rotary

    @rotary.setter
    def rotary(self, value: RotaryEmbedding | None) -> None:
        if value is not None or self.__dict__.get("_hw_host") is not None:
            raise TypeError("the rotary embedding of a patched layer follows the model's config; it cannot be set")


class QKNormLlamaView(QKNormMixin, LlamaView):
    """The layer of a patched ``Qwen3Attention``: :class:`LlamaView` plus the host's ``q_norm`` / ``k_norm``.

    Shapes:
        as :class:`LlamaView`; the norms run over d_h of each split head
    """

    @property
    def q_norm(self) -> nn.Module:
        return self._hw_host.q_norm

    @property
    def k_norm(self) -> nn.Module:
        return self._hw_host.k_norm

    def sources(self) -> list[tuple[str, nn.Module]]:
        return super().sources() + [("q_norm", self._hw_host.q_norm), ("k_norm", self._hw_host.k_norm)]

    def source_names(self) -> dict[str, str]:
        return {**_NAMES, "q_norm": "q_norm", "k_norm": "k_norm"}


class PatchedLlamaStyle:
    """Forward of a patched Llama/Mistral/Qwen2/Qwen3 attention: same signature and return as HF's.

    Shapes:
        hidden_states: (b, s, d); position_embeddings: cos, sin (b or 1, s, d_h)
        -> (b, s, d), weights (b, h, s, s_kv) or None
    """

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, cache: Any = None, **kwargs: Any):
        cache = pop_cache(cache, kwargs)
        attn = self.attn
        q, k, v = attn.project_qkv(hidden_states)  # (b, h, s, d_h), (b, h_kv, s, d_h) x2
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
        results = None if attn.tracer is None else attn.tracer.results(attn)  # a trace's per-head writes
        return attn.project_out(out, results), weights
