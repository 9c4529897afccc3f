"""headwise as a transformers attention implementation: ``attn_implementation="headwise"``.

transformers routes the attention of most of its families through one seam, ``ALL_ATTENTION_FUNCTIONS``: the
attention module projects, normalises and rotates Q/K/V itself, then calls the registered function with
q ``(b, h, s_q, d_qk)``, k ``(b, h_kv, s_kv, d_qk)``, v ``(b, h_kv, s_kv, d_v)`` and the mask, and applies its
own output projection to what comes back. Importing :mod:`headwise.interop` registers :func:`attention_forward`
there under the name ``"headwise"``, with transformers' own ``sdpa_mask`` as its mask function (boolean masks,
True = may attend: headwise's convention; see :func:`mask`), so

* ``AutoModel.from_pretrained(..., attn_implementation="headwise")`` or
  ``model.set_attn_implementation("headwise")`` computes every head with :func:`headwise.functional.attention`;
* a model patched by :func:`headwise.interop.patch` also reports each head to its layer's tracer, so
  :func:`headwise.trace` captures and edits the heads of every family on the interface.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d_qk: query/key head width, d_v: value head width.

Example:
    >>> import torch, transformers
    >>> import headwise.interop                                     # registers "headwise"
    >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                                num_attention_heads=4, num_key_value_heads=2)
    >>> model = transformers.LlamaForCausalLM(cfg).eval()
    >>> ids = torch.tensor([[1, 5, 7, 3]])
    >>> before = model(ids).logits
    >>> model.set_attn_implementation("headwise")
    >>> torch.testing.assert_close(model(ids).logits, before)
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from typing import Any

import torch
from torch import nn

from .. import functional as hwf
from ..masks import validate_mask

__all__ = ["NAME", "register", "attention_forward"]

NAME = "headwise"


def register() -> None:
    """Register :func:`attention_forward` and its mask function with transformers under :data:`NAME` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask)
    _let_configs_ask_for_weights()


def _let_configs_ask_for_weights() -> None:
    """Let ``config.output_attentions = True`` stand on a config whose implementation is ``"headwise"``.

    transformers' config refuses it for every implementation but ``"eager"``, the only built-in one that returns
    weights; headwise returns them whenever they are asked for (:func:`attention_forward`), so the refusal would
    only break code written for eager. transformers has no seam for this rule, so its setter (and its
    ``validate_output_attentions``) are wrapped once: every other implementation keeps transformers' rule."""
    from transformers import PreTrainedConfig

    prop = PreTrainedConfig.__dict__.get("output_attentions")
    if not isinstance(prop, property) or prop.fset is None or getattr(prop.fset, "headwise", False):
        return
    setter, validate = prop.fset, getattr(PreTrainedConfig, "validate_output_attentions", None)

    def fset(self: Any, value: bool) -> None:
        if value and self._attn_implementation == NAME:
            self._output_attentions = value
        else:
            setter(self, value)

    def validate_output_attentions(self: Any) -> None:
        if self._attn_implementation != NAME and validate is not None:
            validate(self)

    fset.headwise = True  # type: ignore[attr-defined]
    PreTrainedConfig.output_attentions = property(prop.fget, fset, prop.fdel, prop.__doc__)
    if validate is not None:
        PreTrainedConfig.validate_output_attentions = validate_output_attentions


#: Modeling code that takes a decision of its own when the implementation is named "sdpa" (Gemma 4 keeps a prefill's
#: queries whole under sdpa when its mask is missing, since the kernel's causal mask is then top-left aligned).
_NAMES_SDPA = re.compile(r"""_attn_implementation\s*==\s*["']sdpa["']""")


@functools.lru_cache(maxsize=None)
def _trusts_is_causal(config_class: type) -> bool:
    """Whether a missing mask may stand for the causal mask in this family, as it does under sdpa.

    It may where transformers runs the family under sdpa (``module.is_causal`` is then read) and the family's
    modeling code decides nothing by the name "sdpa" (headwise's name is not, so such a guard would not protect
    it). Elsewhere every causal mask is materialised: families that run only eager never read their modules'
    ``is_causal`` flags (several say False on causal decoders), and eager treats "no mask" as "attend to
    everything"."""
    from transformers import MODEL_MAPPING

    try:
        model_class = MODEL_MAPPING[config_class]
    except (KeyError, ValueError):
        return False
    if not getattr(model_class, "_supports_sdpa", False):
        return False
    try:
        source = inspect.getsource(sys.modules[model_class.__module__])
    except (OSError, TypeError, KeyError):  # no source to read: nothing says the name is looked at
        return True
    return _NAMES_SDPA.search(source) is None


def mask(*args: Any, config: Any = None, **kwargs: Any) -> torch.Tensor | None:
    """transformers' ``sdpa_mask`` (bool, True = may attend), which may return None for a purely causal mask
    (the kernel's ``is_causal`` is faster) where a missing mask may stand for it (:func:`_trusts_is_causal`), and
    for one query (a decode step) in every family."""
    from transformers.masking_utils import sdpa_mask

    # One query reads every key it may: "no mask" means that in eager too, so the skip (which transformers takes
    # only when no padding or window hides a key) stays allowed there.
    q_length = kwargs.get("q_length", args[1] if len(args) > 1 else None)
    if q_length != 1 and (config is None or not _trusts_is_causal(type(config))):
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, config=config, **kwargs)


#: Keywords that carry a sparse attention selection for kernels that apply it themselves (transformers builds it
#: into the mask only under eager and sdpa, whose names headwise cannot answer to).
_SELECTIONS = ("indices", "block_indices")


def _position_bias_mask(bias: torch.Tensor, mask: torch.Tensor | None, causal: bool, s_q: int,
                        s_kv: int) -> torch.Tensor:
    """T5-style relative position bias combined with the mask into one additive mask, as transformers' sdpa does.

    Shapes: bias (b or 1, h, s_q, s_kv); mask (b or 1, 1, s_q, s_kv) or None -> (b or 1, h, s_q, s_kv)"""
    low = torch.finfo(bias.dtype).min
    if mask is None:
        if not causal:
            return bias
        keep = torch.ones(s_q, s_kv, dtype=torch.bool, device=bias.device).tril()  # top-left, as sdpa's is_causal
        return torch.where(keep, bias, low)
    if mask.dtype == torch.bool:
        return torch.where(mask, bias, low)
    return bias + mask


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, position_bias: torch.Tensor | None = None,
                      softcap: float | None = None, s_aux: torch.Tensor | None = None,
                      sinks: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every head's attention with headwise, in transformers' attention-interface signature.

    Masks and causality follow transformers' sdpa function exactly (the mask function is :func:`mask`): a 4-D
    bool (True = may attend) or float (added) mask is used as given; without one, ``is_causal`` (the keyword,
    else ``module.is_causal``, default True, in families transformers runs under sdpa) applies when ``s_q > 1``,
    after cropping K/V to ``s_q`` when there are more (an empty static cache's prefill). ``position_bias`` (T5's
    relative bias) is added to the scores. ``softcap`` (Gemma 2), ``s_aux`` (a sink logit per head, gpt-oss) and
    ``sinks`` (a sink logit per query row, Inkling 2) go to :func:`headwise.functional.attention`;
    ``sliding_window`` is already in the mask. A sparse selection handed over as ``indices`` or ``block_indices``
    (DeepSeek-V3.2, MiniMax M3: transformers folds it into the mask only under eager and sdpa) is refused with a
    ``ValueError``. The weights are computed (the eager path) when ``output_attentions`` is asked for (as a
    keyword, or by the model recording them) or a trace captures ``"pattern"``; otherwise the fused path runs.

    In a module patched by :func:`headwise.interop.patch`, the layer's tracer sees q, k, v (and may replace
    them) and the per-head context before the module's output projection (and may edit it).

    Args:
        module: the Hugging Face attention module calling.
        query, key, value: the split heads after the module's norms and rotary.
        attention_mask: the prepared 4-D mask, or None.
        dropout: dropout on the probabilities (transformers passes 0.0 in eval mode).
        scaling: score scale (None: ``d_qk ** -0.5``).
        is_causal: overrides ``module.is_causal`` when no mask is given.
        position_bias: an additive per-head bias (T5).
        softcap: logit soft-capping ``softcap * tanh(scores / softcap)``.
        s_aux: one sink logit per query head.
        sinks: one sink logit per query row (at most one of ``s_aux`` and ``sinks``).

    Shapes:
        query (b, h, s_q, d_qk); key (b, h_kv, s_kv, d_qk); value (b, h_kv, s_kv, d_v);
        attention_mask (b or 1, 1, s_q, s_kv); s_aux (h,); sinks (b, h, s_q, 1)
        -> (b, s_q, h, d_v), weights (b, h, s_q, s_kv) or None
    """
    for name in _SELECTIONS:
        if kwargs.get(name) is not None:
            raise ValueError(f"{type(module).__name__} handed headwise a sparse attention selection ({name}=...), "
                             "which transformers folds into the mask only under attn_implementation 'eager' or "
                             "'sdpa'; headwise cannot apply it: run this model with 'sdpa' or 'eager'")
    if s_aux is not None and sinks is not None:
        raise ValueError(f"{type(module).__name__} handed headwise both s_aux (a sink per head) and sinks (a sink "
                         "per query row); at most one sink logit per row is defined")
    layer = module.__dict__.get("_hw_attn")  # set by headwise.interop.patch: the module's headwise layer
    tracer = None if layer is None else layer.tracer
    if layer is not None:
        check_heads(layer, module, query, value)
    s_q, s_kv = query.shape[2], key.shape[2]
    config = getattr(module, "config", None)
    if is_causal is None:  # eager-only families: no mask means no mask (see mask())
        is_causal = getattr(module, "is_causal", True) and config is not None and _trusts_is_causal(type(config))
    causal = bool(is_causal) and attention_mask is None and s_q > 1
    if causal and s_kv > s_q:
        key, value = key[:, :, :s_q], value[:, :, :s_q]  # (b, h_kv, s_q, d): sdpa's top-left causal, cropped
        if position_bias is not None:
            position_bias = position_bias[..., :s_q]
    mask = attention_mask
    if position_bias is not None:
        mask = _position_bias_mask(position_bias, mask, causal, s_q, key.shape[2])
        causal = False
    wants = _weights_asked(kwargs, config)
    if tracer is not None:
        wants = tracer.wants_weights(layer) or wants
        edited = tracer.qkv(layer, query, key, value)
        if edited is not None:
            query, key, value = edited
    extra: dict[str, Any] = {}
    if softcap is not None:
        extra["softcap"] = softcap
    if s_aux is not None or sinks is not None:
        extra["sinks"] = s_aux if sinks is None else sinks
    if layer is None or tracer is not None:  # tensors nobody has checked yet (or a trace's edits): validate all
        z, weights = hwf.attention(query, key, value, mask=mask, scale=scaling, dropout_p=dropout, causal=causal,
                                   backend="eager" if wants else "sdpa", return_weights=wants, **extra)
    else:  # the patched module's own heads, just checked against its layer: plan and run
        if mask is not None:
            mask = validate_mask(mask, (query.shape[0], query.shape[1], s_q, key.shape[2]), query.dtype,
                                 query.device)
        z, weights = hwf.attention(query, key, value, mask=mask, scale=scaling, dropout_p=dropout,
                                           causal=causal, backend="eager" if wants else "sdpa",
                                           return_weights=wants, **extra)
    if tracer is not None:
        z = tracer.context(layer, z, weights)  # (b, h, s_q, d_v), possibly edited
    return z.transpose(1, 2).contiguous(), weights  # (b, s_q, h, d_v)


@functools.lru_cache(maxsize=None)
def _collector() -> Any:
    """transformers' output-capturing context variable (looked up once: a per-call import costs a decode step)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - another transformers layout: the keyword still works
        return None
    return _active_collector


def _weights_asked(kwargs: dict[str, Any], config: Any) -> bool:
    """Whether the caller wants the attention weights: ``output_attentions`` passed down as a keyword, or the
    running model recording them through transformers' output capturing (``output_attentions=True`` that its
    layers never pass down). The capturing decorator already read the keyword or the model's config to decide
    what it records, so the config is read here only when no capturing model is running (a config read costs
    as much as the rest of a decode call's bookkeeping)."""
    collector = _collector()
    collected = None if collector is None else collector.get()
    if isinstance(collected, dict):
        return bool(kwargs.get("output_attentions", False)) or any(k.endswith("attentions") for k in collected)
    return bool(kwargs.get("output_attentions", getattr(config, "output_attentions", False)))


def check_heads(layer: nn.Module, module: nn.Module, query: torch.Tensor, value: torch.Tensor) -> None:
    """The heads transformers hands over must be the heads the layer was built for (edits name heads by index)."""
    cfg = layer.config
    if query.shape[1] == cfg.n_heads and value.shape[1] == cfg.n_kv_heads and value.shape[-1] == cfg.d_head:
        return
    got = (query.shape[1], value.shape[1], value.shape[-1])
    want = (cfg.n_heads, cfg.n_kv_heads, cfg.d_head)
    adopt_kv, adopt = getattr(layer, "adopt_kv_heads", None), getattr(layer, "adopt_heads", None)
    if not ((got[::2] == want[::2] and adopt_kv is not None and adopt_kv(got[1]))
            or (got[2] == want[2] and adopt is not None and adopt(got[0], got[1]))):
        raise ValueError(f"{type(module).__name__} handed headwise (h, h_kv, d_v) = {got}, but its patched layer "
                         f"was built for {want} from the module's config and weights; unpatch and patch again after "
                         "changing the module's head counts")
