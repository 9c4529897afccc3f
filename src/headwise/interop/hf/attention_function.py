"""headwise as a transformers attention implementation: ``attn_implementation="headwise"``.

transformers routes the attention of most of its families through one seam, ``ALL_ATTENTION_FUNCTIONS``: the
attention module projects, normalises and rotates Q/K/V itself, then calls the registered function with
q ``(b, h, s_q, d_qk)``, k ``(b, h_kv, s_kv, d_qk)``, v ``(b, h_kv, s_kv, d_v)`` and the mask, and applies its
own output projection to what comes back. :func:`register` (run when :mod:`headwise.interop` is imported) puts
:func:`attention_forward` there under the name ``"headwise"``, with :func:`mask` as its mask function, through
transformers' public ``AttentionInterface`` / ``AttentionMaskInterface``; nothing of transformers is replaced.

* ``from_pretrained(..., attn_implementation="headwise")`` or ``model.set_attn_implementation("headwise")``:
  every head is computed by :func:`headwise.functional.attention`, with sdpa's conventions. A model built on the
  config object of a model :func:`~headwise.interop.patch` switched (``from_config(model.config)`` shares it) is
  switched with it and keeps the conventions that config had (:func:`config_rule`).
* A model patched by :func:`headwise.interop.patch`: every head of a module is computed by its layer's
  :meth:`~headwise.MultiHeadAttention.attend` (the step :func:`headwise.trace` sees), with the conventions of the
  implementation the model had before patching (the layer's ``rule``), so patching changes no output:

  ========================  =====================================  ==========================================
  the model had             ``"sdpa"``                             ``"eager"``
  ========================  =====================================  ==========================================
  a row that may read       zeros (sdpa's kernel)                  the mean of every value (eager's finfo.min
  no key (padding)                                                 row is uniform; float32's for half inputs,
                                                                   whose scores headwise computes in float32)
  no mask, ``s_q > 1``      causal by ``is_causal`` (the keyword,  no causality (the mask is eager's only
                            else ``module.is_causal``, else True), source of it)
                            after cropping K/V to ``s_q`` (an
                            empty static cache's prefill)
  attention weights         when ``output_attentions=True``        always, but under a trace only where
                            reaches the function                   transformers will record them (below)
  ========================  =====================================  ==========================================

Eager's weights: transformers 5 keeps a module's returned weights only where its model forward records them
(``capture_outputs``: a hook on the module appends them while the forward's output collector holds a key such
as ``"attentions"``, set by ``output_attentions`` given or in the config; GPT-2 drops the keyword before its
modules see it). A module of a model patched from eager returns its weights at every call, as eager's does (a
user's hook may read them), except while :func:`headwise.trace` traces its layer: then, so that a statistics-only
trace holds no ``(b, h, s_q, s_kv)`` pattern, only where that collector holds a key naming attention weights
(``"attentions"``, ``"cross_attentions"``; not ``"router_logits"`` nor hidden states), where
``output_attentions=True`` reaches the function, or where that collector cannot be read: no such forward running
(the module called on its own, a family still on the older ``output_attentions`` code, transformers without that
collector), or a region compiled inside an eager forward (Dynamo reads no ``ContextVar``). Otherwise it
returns None, as sdpa does, and the layer takes its fused or statistics path with eager's rules above: the same
outputs.

The mask function (:func:`mask`) is transformers' ``sdpa_mask`` (bool, True = may attend: headwise's
convention). Where more than one query attends, transformers' skip of a purely causal (or full) mask is kept for
models patched from sdpa, as sdpa keeps it (the module's causality then applies, as under sdpa), unless the family's
code looks for the name ``"sdpa"`` before dropping queries (registry ``names_sdpa``: Gemma 4), and for a family
whose registry entry needs it (``causal_skip``: Dory). Everywhere else (models patched from eager,
``attn_implementation="headwise"`` set directly) the mask is materialised: a missing one would leave causality to
the module's ``is_causal`` flag, which families that only ever ran eager do not keep. One query (a decode step)
reads every key it may under either rule, so transformers may skip its mask anywhere; a model that builds none
(ViT) hands over none. T5's ``position_bias`` is added to the scores;
``softcap`` (Gemma 2), ``s_aux`` (a sink logit per head, gpt-oss) and ``sinks`` (a sink logit per query row,
Inkling 2) are applied; ``head_mask`` scales each head's probabilities and context (:func:`head_factors`).
Under ``torch.autocast`` q, k and v are cast to the autocast dtype (:func:`autocast_heads`), as transformers' sdpa
and eager products cast them (Llama-style rotary hands over float32 q, k beside an autocast v); outside autocast a
dtype mix is refused with a ``TypeError``.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d_qk: query/key head width, d_v: value head width, L: layers.

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

import weakref
from typing import Any

import torch
from torch import nn

from ... import functional as hwf
from ...call_plan import plan_attend
from ...validation import check_qkv
from .layer import RULES, HFView
from .registry import entry_for

__all__ = ["NAME", "register", "attention_forward", "mask", "head_factors", "config_rule", "autocast_heads",
           "output_collector"]

NAME = "headwise"

#: Keywords that carry a sparse attention selection for kernels that apply it themselves (transformers builds it
#: into the mask only under eager and sdpa, whose names headwise cannot answer to).
_SELECTIONS = ("indices", "block_indices")


def register() -> None:
    """Register :func:`attention_forward` and :func:`mask` with transformers under :data:`NAME` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    global _COLLECTOR
    _COLLECTOR = output_collector()
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask)


#: transformers' output collector (:func:`output_collector`), or None where this transformers has none.
_COLLECTOR: Any = None


def output_collector() -> Any:
    """transformers' record of what the running model forward collects (``utils.output_capturing``), or None.

    transformers 5 hands a module's returned attention weights to the caller only through it: ``capture_outputs``
    sets it, for the whole forward, to a dict keyed by what ``output_attentions`` / ``output_hidden_states`` (given
    or in the config) ask, and a hook on each attention module appends the weights while its key is there; the
    keyword itself may never reach the attention function (GPT-2 drops it). No public name exposes it: it is read
    as transformers' own ``CompileableContextVar.get`` reads it (its ``global_var`` under ``torch.compile``, else
    the ``ContextVar``), and taken only where those attributes are there; without it (another transformers) a
    module patched from eager returns its weights at every call, as before."""
    import contextvars

    try:
        from transformers.utils import output_capturing
    except ImportError:
        return None
    found = getattr(output_capturing, "_active_collector", None)
    if isinstance(getattr(found, "context_var", None), contextvars.ContextVar) and hasattr(found, "compiling") \
            and hasattr(found, "global_var"):
        return found
    return None


#: The rule of each patched model's config, by id (:func:`config_rule`). Models patched from sdpa: transformers ran
#: their modules under sdpa, which reads each module's ``is_causal`` when the mask is skipped, so a skipped (purely
#: causal or full) mask may stand for that flag here too. Any model: another model built on the same config object
#: (``from_config(model.config)``) now runs "headwise" too, without layers, and keeps the rule it had. Weak
#: references: a config's entry goes with the config (configs are not hashable).
_CONFIG_RULES: dict[int, tuple[weakref.ref, str]] = {}


def config_rule(config: Any, keep: str | bool | None = None) -> str | None:
    """The rule (``"eager"`` or ``"sdpa"``) recorded for ``config`` when a model of it was patched, or None;
    ``keep`` a rule / False records / forgets it first (:func:`headwise.interop.patch` and ``unpatch`` do)."""
    key = id(config)
    if keep in RULES:
        # the dict bound in the callback: a config may outlive this module's globals (freed at interpreter exit)
        _CONFIG_RULES[key] = (weakref.ref(config, lambda _, key=key, rules=_CONFIG_RULES: rules.pop(key, None)), keep)
    elif keep is False:
        _CONFIG_RULES.pop(key, None)
    elif keep is not None:
        raise ValueError(f"config_rule: keep must be one of {RULES}, False or None, got {keep!r}")
    found = _CONFIG_RULES.get(key)
    return found[1] if found is not None and found[0]() is config else None


def autocast_heads(query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``query, key, value`` in the dtype ``torch.autocast`` (active on their device) computes attention in, as
    transformers' own implementations get it: sdpa and eager's products are autocast ops, which cast every floating
    input but float64 to that dtype (Llama-style rotary hands over float32 q, k beside an autocast v).

    Shapes: unchanged."""
    dtype = torch.get_autocast_dtype(query.device.type)
    cast = [t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in (query, key, value)]
    return cast[0], cast[1], cast[2]


def mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' ``sdpa_mask`` (bool, True = may attend); where more than one query attends, transformers'
    skip of a purely causal (or full) mask is kept only for models patched from sdpa, as sdpa keeps it (the
    kernel's own ``is_causal`` then runs, reading half the scores of a materialised causal mask).

    Elsewhere the mask is materialised: a missing mask would leave the call's causality to the module's
    ``is_causal`` flag, which families that only ever ran eager do not keep, and to code that looks for the name
    ``"sdpa"`` (registry ``names_sdpa``: Gemma 4). One query (a decode step) reads every key it may: there "no mask"
    means that under eager too, so transformers may still skip it; so it may for a family whose registry entry says
    its modules need sdpa's skip (``causal_skip``)."""
    from transformers.masking_utils import sdpa_mask

    q_length = kwargs.get("q_length", args[1] if len(args) > 1 else None)
    config = kwargs.get("config")
    if q_length != 1:
        entry = entry_for(getattr(config, "model_type", None), config)
        if not (entry.causal_skip or (not entry.names_sdpa and config_rule(config) == "sdpa")):
            kwargs["allow_is_causal_skip"] = kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


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


def head_factors(head_mask: Any, module: nn.Module, h: int) -> torch.Tensor | None:
    """The factor of each of this module's ``h`` heads from Hugging Face's ``head_mask`` (1 keeps a head, 0 removes
    it): ``(h,)`` for every layer, or ``(L, h)`` with the module's ``layer_idx`` picking its row (the patched
    model's pre-hook, :func:`~headwise.interop.hf.patch.check_head_mask`, also checks ``L``). Anything else is
    refused with a ``ValueError`` (transformers 5 itself ignores ``head_mask``; headwise never does).

    Shapes: head_mask (h,) or (L, h) -> (h,)"""
    if head_mask is None:
        return None
    where = type(module).__name__
    if not isinstance(head_mask, torch.Tensor) or not (head_mask.dtype.is_floating_point or head_mask.dtype in (
            torch.bool, torch.int64, torch.int32)):
        raise TypeError(f"head_mask must be a tensor of per-head factors, got {type(head_mask).__name__}")
    if head_mask.dim() == 2:
        index = getattr(module, "layer_idx", None)
        if not isinstance(index, int) or not 0 <= index < head_mask.shape[0]:
            raise ValueError(f"head_mask of shape {tuple(head_mask.shape)} has one row per layer, but {where} has "
                             f"layer_idx={index!r}; pass one row (h,) for every layer, or edit heads with "
                             "headwise.trace(model, edit={(layer, head): 0.0})")
        head_mask = head_mask[index]
    if tuple(head_mask.shape) != (h,):
        raise ValueError(f"head_mask must have shape (h={h},) or (layers, h={h}) for {where}, got "
                         f"{tuple(head_mask.shape)} (per-example or per-position masks are not supported)")
    return head_mask.float()


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, position_bias: torch.Tensor | None = None,
                      softcap: float | None = None, s_aux: torch.Tensor | None = None,
                      sinks: torch.Tensor | None = None, head_mask: torch.Tensor | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every head's attention with headwise, in transformers' attention-interface signature.

    A patched module's heads go through its layer's :meth:`~headwise.MultiHeadAttention.attend` (traced), with the
    rule of the implementation its model had (see the module docstring); any other module's through
    :func:`headwise.functional.attention` with the rule recorded for its config (:func:`config_rule`), else
    sdpa's. A sparse selection handed over as ``indices`` or ``block_indices`` (DeepSeek-V3.2, MiniMax M3:
    transformers folds it into the mask only under eager and sdpa) is refused with a ``ValueError``, as are both
    ``s_aux`` and ``sinks`` at once.

    Args:
        module: the Hugging Face attention module calling.
        query, key, value: the split heads after the module's norms and rotary.
        attention_mask: the prepared 4-D mask, or None.
        dropout: dropout on the probabilities (transformers passes 0.0 in eval mode).
        scaling: score scale (None: ``d_qk ** -0.5``).
        is_causal: overrides ``module.is_causal`` when no mask is given (sdpa's rule).
        position_bias: an additive per-head bias (T5).
        softcap: logit soft-capping ``softcap * tanh(scores / softcap)``.
        s_aux: one sink logit per query head.
        sinks: one sink logit per query row (at most one of ``s_aux`` and ``sinks``).
        head_mask: a factor per head, ``(h,)`` or ``(L, h)`` (:func:`head_factors`).

    Shapes:
        query (b, h, s_q, d_qk); key (b or 1, h_kv, s_kv, d_qk); value (b or 1, h_kv, s_kv, d_v) (batch 1: an
        encoder output read by every example, expanded to b as eager and sdpa broadcast it);
        attention_mask (b or 1, 1, s_q, s_kv); s_aux (h,); sinks (b, h, s_q, 1)
        -> (b, s_q, h, d_v), weights (b, h, s_q, s_kv) or None
    """
    for name in ("decoder_head_mask", "cross_attn_head_mask"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{type(module).__name__} handed headwise {name}=..., which it does not apply: edit "
                             "heads with headwise.trace(model, edit={(layer, head): 0.0})")
    for name in _SELECTIONS:
        if kwargs.get(name) is not None:
            raise ValueError(f"{type(module).__name__} handed headwise a sparse attention selection ({name}=...), "
                             "which transformers folds into the mask only under attn_implementation 'eager' or "
                             "'sdpa'; headwise cannot apply it: run this model with 'sdpa' or 'eager'")
    if s_aux is not None and sinks is not None:
        raise ValueError(f"{type(module).__name__} handed headwise both s_aux (a sink per head) and sinks (a sink "
                         "per query row); at most one sink logit per row is defined")
    layer = module.__dict__.get("attn")  # set by headwise.interop.patch: the module's headwise layer
    ref = layer.__dict__.get("_hw_host") if isinstance(layer, HFView) else None  # a weak reference (views.HostRef)
    if ref is None or ref.ref() is not module:  # calling it is a C call: no Python frame here
        layer = None
    if layer is not None:
        eager = layer.rule == "eager"  # an attribute: no call on this path
    else:  # a model sharing a patched model's config (switched with it) keeps the rule that config had
        eager = config_rule(getattr(module, "config", None)) == "eager"
    kind, given = query.device.type, None
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        given = query.dtype  # transformers' eager returns its weights in the query's dtype as handed over
        query, key, value = autocast_heads(query, key, value)
    if key.shape[0] == 1 != query.shape[0]:  # one encoder output for a decoder batch: eager's matmul broadcasts it
        key, value = key.expand(query.shape[0], -1, -1, -1), value.expand(query.shape[0], -1, -1, -1)  # views
    s_q, s_kv = query.shape[2], key.shape[2]
    mask = attention_mask
    causal = False
    if mask is None and not eager and s_q > 1:
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        if causal and s_kv > s_q:
            key, value = key[:, :, :s_q], value[:, :, :s_q]  # (b, h_kv, s_q, d): sdpa's top-left causal, cropped
            if position_bias is not None:
                position_bias = position_bias[..., :s_q]
    elif eager and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:  # eager's own additive mask
        # In the dtype the scores are computed in (float32 for half inputs): float16's minimum added to float32
        # scores would not swamp them, and a row that may read nothing would not be eager's uniform one.
        low = torch.promote_types(query.dtype, torch.float32)
        zero = torch.zeros((), dtype=low, device=mask.device)
        mask = torch.where(mask, zero, torch.finfo(low).min)  # (b or 1, 1, s_q, s_kv)
    elif eager and isinstance(mask, torch.Tensor) and mask.dtype in (torch.float16, torch.bfloat16):
        # A half-precision additive mask (a user's, in eager's convention): its minimum swamps eager's half scores,
        # not float32 ones, so entries at it are sent to float32's (tensor operations only: no read of the mask).
        mask = mask.float().masked_fill(mask <= torch.finfo(mask.dtype).min / 2, torch.finfo(torch.float32).min)
    if position_bias is not None:
        mask = _position_bias_mask(position_bias, mask, causal, s_q, key.shape[2])
        causal = False
    wants = bool(kwargs.get("output_attentions", False))
    if eager and not wants:  # eager's weights where they may be read (the module docstring)
        if layer is None or layer.tracer is None:
            wants = True  # untraced: eager's, at every call (a user's hook may read them)
        else:  # transformers' collector read as its own get() reads it: attributes and a C call, no Python frame
            col = _COLLECTOR
            # Dynamo reads no ContextVar: a region compiled inside an eager forward (a layer's compile) keeps them
            found = None if col is None or (not col.compiling and torch.compiler.is_compiling()) else \
                col.global_var if col.compiling else col.context_var.get()
            wants = found is None
            for recorded in () if wants else found:  # "attentions", "cross_attentions", a family's: no router_logits
                if "attention" in recorded:
                    wants = True
                    break
    sinks = s_aux if sinks is None else sinks
    factors = None if head_mask is None else head_factors(head_mask, module, query.shape[1])
    # eager's mask in the scores' dtype, wider than half-precision inputs: headwise would round it to theirs
    # (float32's minimum to -inf, so a row that may read nothing to zeros)
    wide = eager and isinstance(mask, torch.Tensor) and mask.dtype == torch.promote_types(query.dtype, torch.float32) \
        and mask.dtype != query.dtype
    if layer is None:
        dtype = query.dtype
        if wide:  # no trace sees this path: the inputs are widened to the mask's dtype, the outputs rounded back
            query, key, value = query.to(mask.dtype), key.to(mask.dtype), value.to(mask.dtype)
        z, weights = hwf.attention(query, key, value, mask=mask, scale=scaling, dropout_p=dropout, causal=bool(causal),
                                   backend="eager" if wants else "sdpa", return_weights=wants, softcap=softcap,
                                   sinks=sinks)
        if factors is not None:
            f = factors.to(z.dtype).view(1, -1, 1, 1)  # (1, h, 1, 1)
            z, weights = z * f, None if weights is None else weights * f
        if wide:
            z, weights = z.to(dtype), None if weights is None else weights.to(dtype)
    else:
        cfg = layer.config
        if query.shape[1] != cfg.n_heads or value.shape[1] != cfg.n_kv_heads or value.shape[-1] != cfg.d_head:
            adopt(layer, module, query, value)
        kw = dict(causal=bool(causal), return_weights=wants, scale=None if scaling == cfg.scale else scaling,
                  softcap=softcap, sinks=sinks, dropout=dropout, head_scale=factors)
        plan = None
        if wide:  # planned here, so the mask reaches the (eager) kernel as it is; the trace sees q, k, v as given
            check_qkv(query, key, value)
            plan, checked = plan_attend(layer, query, key, value, mask=mask, tracer=layer.tracer,
                                        backend=layer.backend, **kw)
            mask = mask.view(checked.shape)  # (b or 1, h or 1, s_q, s_kv)
        z, weights = layer.attend(query, key, value, mask=mask, plan=plan, **kw)
    if given is not None and weights is not None:
        weights = weights.to(given)
    return z.transpose(1, 2).contiguous(), weights  # (b, s_q, h, d_v)


def adopt(layer: HFView, module: nn.Module, query: torch.Tensor, value: torch.Tensor) -> None:
    """Heads that differ from the ones the layer was built for: the layer adopts them where no located weight fixes
    them (:meth:`~headwise.interop.hf.layer.HFView.adopt_heads`), else this refuses (edits name heads by index)."""
    cfg = layer.config
    got = (query.shape[1], value.shape[1], value.shape[-1])
    want = (cfg.n_heads, cfg.n_kv_heads, cfg.d_head)
    if not ((got[::2] == want[::2] and layer.adopt_kv_heads(got[1]))
            or (got[2] == want[2] and layer.adopt_heads(got[0], got[1]))):
        raise ValueError(f"{type(module).__name__} handed headwise (h, h_kv, d_v) = {got}, but its patched layer "
                         f"was built for {want} from the module's config and weights; unpatch and patch again after "
                         "changing the module's head counts")
