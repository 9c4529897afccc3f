"""One Hugging Face attention module <-> one standalone :class:`~headwise.MultiHeadAttention`: :func:`from_hf`,
:func:`to_hf`.

Both read the module through its family's registry entry (:mod:`~headwise.interop.hf.registry`), as
:func:`~headwise.interop.patch` does, so every family whose Q/K/V and W_O the registry locates converts, in every
layout (separate ``nn.Linear``, a fused Q/K/V in blocks or head by head, GPT-2's ``Conv1D``), both ways, weights
exact. A module whose W_O lives in its parent (BERT: ``BertSelfOutput.dense``) converts from the parent
(``BertAttention``), which holds exactly one attention module.

Shapes:
    d: model width, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

import copy
import math
import warnings

import torch
from torch import nn

from ...attention import MultiHeadAttention
from ...config import AttentionConfig
from ...module_calls import adapter_base
from .layer import HFView, QKNormHFView, is_target, view_of
from .qk_norm import QKNormAttention, QKNormMixin
from .registry import sliding_window_of
from .rope import rotary_from_hf

__all__ = ["from_hf", "to_hf"]

_WRITTEN = ("q_proj", "k_proj", "v_proj", "out_proj")


def _view(module: object, what: str) -> HFView:
    """The (unattached) view of ``module``: an attention module on the interface, or the one such child of a block
    that holds its W_O; every projection must be located."""
    if not isinstance(module, nn.Module) or isinstance(module, MultiHeadAttention):
        raise TypeError(f"{what}: expected a Hugging Face attention module (or the block holding one and its W_O), "
                        f"got {type(module).__name__}")
    target, parent = module, None
    if not is_target(module):
        inner = [child for child in module.children() if is_target(child)]
        if len(inner) != 1:
            raise TypeError(f"{what}: {type(module).__name__} is not a supported attention module: headwise converts "
                            "modules that call transformers' attention interface (ALL_ATTENTION_FUNCTIONS), or a "
                            f"block holding exactly one of them and its W_O (it holds {len(inner)})")
        target, parent = inner[0], module
    view = view_of(target, parent)
    why = view.located
    missing = next((w for w in why.values() if w), "")
    if missing:
        hint = ("; pass the module that holds W_O (its parent, e.g. BertAttention for BertSelfAttention)"
                if why["out_proj"] and parent is None and not any(why[p] for p in ("q_proj", "k_proj", "v_proj"))
                else "")
        raise ValueError(f"{what}: {type(target).__name__} cannot be converted: {missing}{hint}")
    if view._hw_odd:
        raise ValueError(f"{what}: {type(target).__name__} cannot be converted: {view._hw_odd}")
    # A PEFT wrapper's weight is its base layer's: copying or writing it would drop (or leave) the adapter's delta.
    wrapped = [f"{n} ({type(m).__module__}.{type(m).__qualname__})" for n, m in view.sources()
               if adapter_base(m) is not None]
    if wrapped:
        raise ValueError(f"{what}: {type(target).__name__} cannot be converted: {', '.join(wrapped)} wrapped by an "
                         "adapter (PEFT), whose delta is not in the base weight: merge_and_unload() first")
    return view


def from_hf(module: nn.Module, *, rotary_emb: nn.Module | None = None) -> MultiHeadAttention:
    """A standalone :class:`~headwise.MultiHeadAttention` holding a copy of one Hugging Face attention module's
    weights, its scale and dropout.

    Where the registry says the family rotates Q/K from its config the layer gets a :class:`~headwise.RotaryEmbedding`
    equal to the model's (pass the model's ``rotary_emb`` module to copy its frequencies for non-default rope
    types), and where it names per-head QK-norms a :class:`~headwise.interop.hf.qk_norm.QKNormAttention` with copies
    of them. Where the entry says ``standalone`` the copy computes what the module computes; elsewhere it holds the
    weights only (the module adds what the registry does not describe: softcap, sinks, gates, its own rotary), and
    a ``UserWarning`` says so. A sliding window lives in the model's mask, not in the module: a module with one
    shorter than ``max_position_embeddings`` (Mistral, Qwen2's ``use_sliding_window`` layers, Gemma 2's local
    layers) gets a ``UserWarning`` naming it, since the copy attends past it unless a call passes
    ``mask=headwise.masks.sliding_window_mask(s_q, s_kv, window=W)`` (decoding past the window is not windowed).

    Raises ``TypeError`` for anything but an attention module (or its block), ``ValueError`` naming why a
    projection is not located (CodeGen's sharded Q/K/V, multi-head latent attention) or which projection a PEFT
    adapter wraps (its delta is not in the base weight: ``merge_and_unload()`` first).

    Shapes:
        module (d, h, h_kv, d_h) -> MultiHeadAttention(d, h, h_kv, d_head=d_h[, rotary])

    Example:
        >>> import torch, transformers
        >>> cfg = transformers.GPT2Config(n_embd=12, n_head=3, n_layer=1)
        >>> block = transformers.GPT2Model(cfg).h[0].attn
        >>> attn = from_hf(block)
        >>> x = torch.randn(1, 4, 12)
        >>> torch.testing.assert_close(attn.q_proj(x), x @ block.c_attn.weight[:, :12] + block.c_attn.bias[:12])
    """
    view = _view(module, "from_hf")
    entry, host = view.entry, view.host
    if rotary_emb is not None and not entry.rotary:
        raise TypeError(f"from_hf: rotary_emb given, but {type(host).__name__}'s registry entry has no rotary for "
                        "the layer (its rotary, if any, stays in the module's forward)")
    if not entry.standalone:
        warnings.warn(f"from_hf: {type(host).__name__}'s attention is more than the copy holds "
                      f"({view.standalone_refusal().split(': ', 1)[-1]}): the copy has its weights and scale, and "
                      "its forward is plain attention", UserWarning, stacklevel=2)
    window = _sliding_window(host)
    if window is not None:
        warnings.warn(f"from_hf: {type(host).__name__} attends within a sliding window of {window} positions (the "
                      "model's mask), the copy has no window: for calls longer than that pass "
                      f"mask=headwise.masks.sliding_window_mask(s_q, s_kv, window={window}) (causal=True and "
                      "DecodeStep attend past it; decoding past the window is not windowed)", UserWarning,
                      stacklevel=2)
    rotary = rotary_from_hf(host.config, view.d_head, rotary_emb) if entry.rotary else None
    weights = {p: (view.projection(p).weight(), view.projection(p).bias()) for p in ("q_proj", "k_proj", "v_proj",
                                                                                    "out_proj")}
    like = weights["q_proj"][0]
    extra = {}
    cls = MultiHeadAttention
    if isinstance(view, QKNormHFView):
        cls, extra = QKNormAttention, {"q_norm": copy.deepcopy(view.q_norm), "k_norm": copy.deepcopy(view.k_norm)}
    attn = cls.from_config(view.config, rotary=rotary, backend=view.backend, device=like.device, dtype=like.dtype,
                           **extra)
    with torch.no_grad():
        for name, (weight, bias) in weights.items():
            layer = getattr(attn, name)
            layer.weight.copy_(weight)
            if bias is not None:
                layer.bias.copy_(bias)
    return attn.train(host.training)  # a fresh module is in training mode: dropout must follow the HF module


def _sliding_window(host: nn.Module) -> int | None:
    """The sliding window ``host``'s model masks it with (:func:`~.registry.sliding_window_of`), where one is
    shorter than the model's positions."""
    config = getattr(host, "config", None)
    window = sliding_window_of(host, config)
    longest = getattr(config, "max_position_embeddings", None)
    return window if window is None or not isinstance(longest, int) or window < longest else None


def _check_same(owner: str, want: AttentionConfig, got: AttentionConfig) -> None:
    """``got`` (a MultiHeadAttention's config) must describe the same layer as ``want`` (the module's)."""
    fields = ("d_model", "n_heads", "n_kv_heads", "d_head", "bias", "out_bias", "kdim", "vdim")
    diff = {f: (getattr(want, f), getattr(got, f)) for f in fields if getattr(want, f) != getattr(got, f)}
    # 1/sqrt(d_h) and d_h ** -0.5 may differ in the last bit; anything more is a different layer.
    if not math.isclose(want.scale, got.scale, rel_tol=1e-6):
        diff["scale"] = (want.scale, got.scale)
    if diff:
        detail = ", ".join(f"{f}: module {a!r} vs attn {b!r}" for f, (a, b) in diff.items())
        raise ValueError(f"cannot write this MultiHeadAttention into {owner}: {detail}")


def _check_rotary(owner: str, view: HFView, attn: MultiHeadAttention) -> None:
    """``attn``'s rotary must be the module's: none where the registry gives the family none, else the frequencies
    its config gives (what :func:`from_hf` builds).

    Args:
        owner: the module's class name, for the message.
        view: the module's view (its registry entry and config-derived rotary).
        attn: the layer to be written.
    """
    if (attn.rotary is not None) != view.entry.rotary:
        module = "rotates Q and K with the model's rotary" if view.entry.rotary else "has no rotary the layer can hold"
        layer = "has none" if attn.rotary is None else f"has a {type(attn.rotary).__name__}"
        raise ValueError(f"cannot write this MultiHeadAttention into {owner}: the module {module}, the layer {layer}")
    want, got = view.rotary, attn.rotary
    if want is None or got is None:  # nothing to compare (no rotary, or none the config alone determines)
        return
    # The same formula's frequencies up to bfloat16's rounding, the coarsest they are held in: a cast layer
    # (.half(), .to(bfloat16)) or a model's own rotary_emb cast with its model. Another base or rope scaling
    # moves them by far more.
    rtol = torch.finfo(torch.bfloat16).eps
    same = (want.rotary_dim == got.rotary_dim
            and math.isclose(want.attention_scaling, got.attention_scaling, rel_tol=1e-6)
            and torch.allclose(want.inv_freq, got.inv_freq.detach().to("cpu", torch.float32), rtol=rtol, atol=0))
    if not same:
        raise ValueError(f"cannot write this MultiHeadAttention into {owner}: its rotary differs from the one the "
                         f"model's config gives (rotary_dim {want.rotary_dim}, attention_scaling "
                         f"{want.attention_scaling}, inv_freq {want.inv_freq.tolist()}), the layer's has rotary_dim "
                         f"{got.rotary_dim}, attention_scaling {got.attention_scaling}, inv_freq "
                         f"{got.inv_freq.tolist()}")


def to_hf(attn: MultiHeadAttention, like: nn.Module) -> nn.Module:
    """A new Hugging Face module of ``like``'s class and config holding ``attn``'s weights.

    ``like`` is deep-copied (parts outside the attention, such as ``BertSelfOutput.LayerNorm``, keep ``like``'s
    values) and every weight is written in the module's own layout after a shape check; a layer of another size,
    head grouping, bias layout, scale, QK-norm or rotary (one where the family has none, none where it rotates, or
    other frequencies than the config gives) raises ``ValueError``, as does a projection wrapped by a PEFT adapter
    (``merge_and_unload()`` first); one whose weight is recomputed on use (a parametrization such as
    ``weight_norm``: a write would be lost) raises ``TypeError`` naming it. ``to_hf(from_hf(m), like=m)``
    reproduces ``m``'s weights exactly.

    Shapes:
        attn: MultiHeadAttention matching like (d, h, h_kv, d_h) -> module of type(like)

    Example:
        >>> import torch, transformers
        >>> cfg = transformers.BertConfig(hidden_size=12, num_attention_heads=3, num_hidden_layers=1,
        ...                               intermediate_size=8, vocab_size=10)
        >>> block = transformers.BertModel(cfg).encoder.layer[0].attention
        >>> again = to_hf(from_hf(block), like=block)
        >>> all(torch.equal(a, b) for a, b in zip(block.state_dict().values(), again.state_dict().values()))
        True
    """
    if not isinstance(attn, MultiHeadAttention):
        raise TypeError(f"to_hf: attn must be a MultiHeadAttention, got {type(attn).__name__}")
    view = _view(like, "to_hf")  # checked before paying for the copy
    owner = type(view.host).__name__
    _check_same(owner, view.config, attn.config)
    norm = isinstance(view, QKNormHFView)
    if norm != isinstance(attn, QKNormMixin):
        raise ValueError(f"cannot write this {type(attn).__name__} into {owner}: the module "
                         f"{'has' if norm else 'has no'} per-head q_norm/k_norm and the layer "
                         f"{'has' if isinstance(attn, QKNormMixin) else 'has none'}")
    _check_rotary(owner, view, attn)
    # A parametrized projection (weight_norm ...) recomputes its weight on use: a write into it would be lost.
    lost = next((why for name in _WRITTEN if (why := view.projection(name).unwritable())), "")
    if lost:
        raise TypeError(f"to_hf: cannot write into {owner}'s {lost}")
    new = copy.deepcopy(like)
    target = _view(new, "to_hf")
    for name in _WRITTEN:
        src = getattr(attn, name)
        target.projection(name).write(src.weight, src.bias)
    if norm:
        for name in ("q_norm", "k_norm"):
            want, got = getattr(target, name).state_dict(), getattr(attn, name).state_dict()
            if want.keys() != got.keys():
                raise ValueError(f"{owner}.{name} has {sorted(want)}, the layer's {name} has {sorted(got)}")
            with torch.no_grad():
                for key in want:
                    if tuple(want[key].shape) != tuple(got[key].shape):
                        raise ValueError(f"{owner}.{name}.{key}: expected shape {tuple(want[key].shape)}, got "
                                         f"{tuple(got[key].shape)}")
                    want[key].copy_(got[key])
    return new
