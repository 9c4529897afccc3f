"""The adapter for any Hugging Face attention module that calls transformers' attention interface.

Such a module (OPT, Phi-3, GPT-NeoX, Gemma 2, DeepSeek-V3, ELECTRA, ViT, ...) projects, normalises and rotates
its own Q/K/V, then calls the function registered for its ``config._attn_implementation`` in
``ALL_ATTENTION_FUNCTIONS``. :class:`InterfaceAdapter` calls the module the way its model does, whatever its
forward's keywords: the 4-D mask in the form its implementation's mask function builds (bool, True = may attend,
for ``"headwise"`` and ``"sdpa"``; additive ``finfo.min`` for ``"eager"``), the rotary ``(cos, sin)`` from the
family's own rotary class, ``position_ids`` / ``cache_position`` where it takes them, and the library's
``DynamicCache`` for the decode path. Attention weights, and the q / k the scores see, are read at the seam: for
one call the module's implementation is a thin wrapper (registered in the local mapping of the interface its
family's forward reads, removed afterwards) around the family's eager function, or around headwise's when the
module runs headwise (patched). A scale the module folds into q before the call is found and counted in.

Heads come from the module's :class:`~headwise.interop.hf_generic.InterfaceView` (where
:mod:`~headwise.interop.hf_registry` locates Q/K/V and W_O): head ``i``'s W_Q rows are ``view.head(i).w_q``. Where
they are not located (multi-head latent attention, CodeGen's sharded ``qkv_proj``), head independence is not
applicable and says why.

Shapes:
    b: batch, s: tokens, d: model width, h: query heads, h_kv: key/value heads, d_h: value head width,
    d_qk: query/key head width. run: x (b, s, d) -> (b, s, d); weights (b, h, s, s); contexts (b, h, s, d_h).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Iterator

import torch
from torch import nn

from ..interop import hf_generic
from ..interop.hf_interface import NAME as HEADWISE
from ..interop.hf_registry import entry_for
from .adapters import capture_input, check_rotary_scaling, copy_adapter, split
from .hf_adapters import HFAdapter, hf_class

__all__ = ["InterfaceAdapter", "is_interface_module"]

# The implementation name the check's wrapper is registered under, for the length of one call.
_KEY = "headwise_check"
_CACHE_KW = ("cache", "past_key_values", "past_key_value", "layer_past")
_CROSS_KW = ("key_value_states", "encoder_hidden_states")
_SUPPLIED = {"attention_mask", "position_embeddings", "position_ids", "cache_position", *_CACHE_KW}


def is_interface_module(module: Any) -> bool:
    """A Hugging Face attention module (patched or not) whose forward calls transformers' attention interface."""
    cls = hf_class(module) if isinstance(module, nn.Module) else None
    return cls is not None and hasattr(module, "config") and hf_generic.calls_interface(cls)


class InterfaceAdapter(HFAdapter):
    """``headwise.check`` on an attention module of the interface: unpatched, patched by
    :func:`headwise.interop.patch`, or the :class:`~headwise.interop.hf_generic.InterfaceView` from
    :func:`headwise.interop.layers`.

    ``causal=None``: the module's own ``is_causal`` (else its config's ``is_decoder``); a sliding window from the
    config (:func:`~headwise.checks.hf_adapters.sliding_window_of`). Raises ``TypeError`` for a module that is
    not on the interface or a forward needing inputs the adapter cannot build, ``ValueError`` for
    cross-attention or a rotary module whose family has no rotary class.

    Shapes:
        module: hidden_states (b, s, d) -> (b, s, d)

    Example:
        >>> import transformers
        >>> cfg = transformers.OPTConfig(vocab_size=32, hidden_size=16, num_attention_heads=4, ffn_dim=32,
        ...                              num_hidden_layers=1, word_embed_proj_dim=16)
        >>> module = transformers.OPTForCausalLM(cfg).model.decoder.layers[0].self_attn
        >>> ad = InterfaceAdapter(module)
        >>> ad.claims_causal, ad.exposes_heads, (ad.n_heads, ad.d_head)
        (True, True, (4, 4))
    """

    precision = torch.float32  # the families' eager softmax runs in float32 whatever the input dtype

    def __init__(self, module: nn.Module | hf_generic.InterfaceView, *, causal: bool | None = None,
                 name: str | None = None) -> None:
        view = module if isinstance(module, hf_generic.InterfaceView) else None
        module = view.host if view is not None else module
        if not is_interface_module(module):
            raise TypeError(f"InterfaceAdapter checks a Hugging Face attention module that calls transformers' "
                            f"attention interface, got {type(module).__name__}")
        where = name or (view.host_name if view is not None else None) or ""
        self.params = _keywords(module)
        why = _cross(module, self.params, where, causal)
        if why:
            raise ValueError(f"{type(module).__name__}{f' at {where!r}' if where else ''} is cross-attention ({why}): "
                             "headwise.check checks self-attention, whose keys and values come from its own input")
        super().__init__(module, causal=False, name=name or hf_class(module).__name__)
        self.claims_causal = self._own_claim() if causal is None else bool(causal)
        self.accepts_mask = self.accepts_causal = "attention_mask" in self.params
        cache_kw = [k for k in _CACHE_KW if k in self.params]
        self.cache_kw = cache_kw[0] if cache_kw else None
        self.has_cache = self.cache_kw is not None and isinstance(getattr(module, "layer_idx", None), int) \
            and self.accepts_mask
        self.rope = self._rotary() if "position_embeddings" in self.params else None
        self.positional = self.rope is not None or "position_ids" in self.params
        self._bind(hf_generic.from_module(module))

    def _own_claim(self) -> bool:
        """Causal when the module says so, or is a decoder's (self-attention) module: some (BigBird-Pegasus) leave
        ``is_causal`` False and rely on the model's causal mask."""
        return getattr(self.module, "is_causal", None) is True or getattr(self.module, "is_decoder", None) is True \
            or (getattr(self.module, "is_causal", None) is None and getattr(self.config, "is_decoder", False) is True)

    def _rotary(self) -> nn.Module:
        """The family's rotary embedding (the class the model builds: ``<Family>RotaryEmbedding``)."""
        cls = hf_class(self.module)
        family = sys.modules[cls.__module__]
        found = {n: getattr(family, n) for n in dir(family) if n.endswith("RotaryEmbedding")
                 and isinstance(getattr(family, n), type)}
        own = cls.__name__.replace("Attention", "RotaryEmbedding")
        pick = found.get(own) or (next(iter(found.values())) if len(found) == 1 else None)
        if pick is None:
            raise ValueError(f"{self.name} takes position_embeddings, but its family module {family.__name__} has "
                             f"{'no' if not found else 'more than one'} rotary embedding class "
                             f"({sorted(found)}) to build them with")
        rope = pick(config=self.config).to(self.device)
        check_rotary_scaling(rope, self.name)
        return rope

    def _bind(self, view: hf_generic.InterfaceView) -> None:
        """Sizes and heads from the module's view (rebuilt for each copy: it follows its own module)."""
        self.view = view
        cfg = view.config
        self.d_model, self.n_heads, self.n_kv_heads, self.d_head = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, \
            cfg.d_head
        located = view.located
        why = located["q_proj"] or located["k_proj"] or located["v_proj"]
        self.out = None
        if not why and not located["out_proj"]:
            self.out = view.resolve("out_proj")
            if not any(m is self.out for m in self.module.modules()):
                why = f"its W_O ({type(self.out).__name__}) is outside the module"
        elif not why:
            names = entry_for(getattr(self.config, "model_type", None), self.config).o
            inside = [n for n in names if isinstance(getattr(self.module, n, None), nn.Module)]
            if inside:  # an output projection the registry could not match: its input is not known to be heads
                why = f"W_O is not located ({located['out_proj']})"
        self.exposes_heads = not why
        self.no_heads_reason = f"{self.name} exposes no heads: {why}" if why else ""

    # -- calling ------------------------------------------------------------------------------------
    def _impl(self) -> str:
        impl = self.config._attn_implementation
        return impl if impl in ("eager", "sdpa", HEADWISE) else "eager"

    def _mask(self, b, q_pos, k_pos, keep, causal, dtype, device):
        additive = super()._mask(b, q_pos, k_pos, keep, causal, dtype, device)  # (b, 1, s_q, s_kv)
        if (self.seam_impl or self._impl()) == "eager":
            return additive
        return additive == 0  # what transformers' sdpa_mask (and headwise's) build: True = may attend

    def _position_embeddings(self, x, positions):
        position_ids = positions.expand(x.shape[0], -1) if positions.dim() == 1 else positions
        if "layer_type" in inspect.signature(self.rope.forward).parameters:
            types, index = getattr(self.config, "layer_types", None), getattr(self.module, "layer_idx", None)
            kind = types[index] if isinstance(types, (list, tuple)) and isinstance(index, int) else None
            return self.rope(x, position_ids, kind)
        return self.rope(x, position_ids)

    def _forward(self, x, mask, positions=None, cache=None):
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        kw: dict[str, Any] = {}
        if self.accepts_mask:
            kw["attention_mask"] = mask
        if self.rope is not None:
            kw["position_embeddings"] = self._position_embeddings(x, positions)
        if "position_ids" in self.params:
            kw["position_ids"] = positions.expand(x.shape[0], -1) if positions.dim() == 1 else positions
        if "cache_position" in self.params and positions.dim() == 1:
            kw["cache_position"] = positions
        if cache is not None:
            kw[self.cache_kw] = cache
        out = self.module(x, **kw)
        return out if isinstance(out, tuple) else (out,)

    @contextlib.contextmanager
    def _seam(self, *, weights: bool) -> Iterator[list[tuple[torch.Tensor, ...]]]:
        """For one call, route the module's attention through a wrapper that records (q, k, weights)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as shared

        family = sys.modules[hf_class(self.module).__module__]
        functions = getattr(family, "ALL_ATTENTION_FUNCTIONS", shared)  # the mapping its forward reads (Doge: own)
        impl = self._impl()
        if impl == "sdpa" and weights:
            impl = "eager"  # sdpa computes no weights; transformers' own answer is the eager function
        base = getattr(family, "eager_attention_forward", None) if impl == "eager" else functions[impl]
        if base is None:
            raise TypeError(f"{self.name}: its family module has no eager_attention_forward to compute weights with")
        got: list[tuple[torch.Tensor, ...]] = []

        def wrapper(module, query, key, value, attention_mask, **kwargs):
            if impl == HEADWISE and weights:
                kwargs["output_attentions"] = True
            z, w = base(module, query, key, value, attention_mask, **kwargs)
            got.append((query, key, w))
            return z, w

        old = self.config._attn_implementation
        functions[_KEY] = wrapper
        self.config._attn_implementation = _KEY
        self.seam_impl = impl  # the masks follow the wrapped implementation
        try:
            yield got
        finally:
            self.config._attn_implementation = old
            del functions[_KEY]
            self.seam_impl = None

    seam_impl: str | None = None

    def run_weights(self, x, *, keep=None, causal=None):
        causal = self.causal_flag(causal)
        pos = torch.arange(x.shape[1], device=x.device)
        with self._seam(weights=True) as got:
            y = self._forward(x, self._mask(x.shape[0], pos, pos, keep, causal, x.dtype, x.device))[0]
        return y, got[-1][2]

    def run(self, x, *, keep=None, causal=None, positions=None):
        if positions is not None and not self.positional:
            raise ValueError(f"{self.name} takes no positions")
        if not self.accepts_mask and (keep is not None or self.causal_flag(causal)):
            raise ValueError(f"{self.name} takes no attention_mask")
        return super().run(x, keep=keep, causal=causal, positions=positions)

    def qk(self, x):
        """q and k as the interface gets them (after the module's norms and rotary), with a scale the module folded
        into q before the call (OPT, Whisper, ESM multiply q by 1/sqrt(d_qk) and pass scaling=1) taken back out,
        so that the fitted scale is the whole scale of the scores."""
        pos = torch.arange(x.shape[1], device=x.device)
        outs: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(lambda mod, args, out: outs.append(out)) for m in self.module.modules()
                 if isinstance(m, nn.Linear)]
        try:
            with self._seam(weights=False) as got:
                self._forward(x, self._mask(x.shape[0], pos, pos, None, False, x.dtype, x.device))
        finally:
            for handle in hooks:
                handle.remove()
        q, k = got[-1][0], got[-1][1]  # (b, h, s, d_qk), (b, h_kv, s, d_qk)
        # A rotary attention_scaling (YaRN: cos and sin times mscale) scales q and k alike and is part of the
        # scores the kernel sees, not a factor the module folded into q.
        rotary = 1.0 if self.rope is None else float(getattr(self.rope, "attention_scaling", None) or 1.0)
        folded = _folded_scale(q, outs) / rotary
        return (q if abs(folded - 1) < 1e-4 else q / folded), k

    def contexts(self, x, *, causal=None):
        if self.out is None:  # W_O is applied by the parent: the module's output is the merged contexts
            return split(self.run(x, causal=causal), self.n_heads)
        with capture_input(self.out) as got:
            self.run(x, causal=causal)
        return split(got[0], self.n_heads)  # (b, h, s, d_h)

    def head_slices(self, which, index):
        group = self.n_heads // self.n_kv_heads
        head = self.view.head(index if which == "q" else index * group)
        weight, bias = getattr(head, f"w_{which}"), getattr(head, f"b_{which}")  # live views of the module's rows
        return [(weight, 0, 0, weight.shape[0])] + ([] if bias is None else [(bias, 0, 0, bias.shape[0])])

    def converted(self, dtype):
        new = copy_adapter(self, dtype)
        new.config = new.module.config
        if new.config._attn_implementation not in ("sdpa", HEADWISE):  # unset (a module built outside a model),
            new.config._attn_implementation = "eager"  # or a kernel for other hardware: HF's reference function
        if self.rope is not None:
            new.rope = type(self.rope)(config=new.config).to(new.device)
        new._bind(hf_generic.from_module(new.module))
        return new


def _cross(module: nn.Module, params: set[str], where: str, causal: bool | None) -> str:
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


def _folded_scale(q: torch.Tensor, outs: list[torch.Tensor]) -> float:
    """The factor between the q the interface got and the projection that made it, where the module multiplied
    one by a constant: each (token, head) row of q has the norm of that head's rows of some projection's output
    (its first h * d_qk columns) times the same factor (rotary rotates, so norms survive it; a per-head norm would
    not keep one factor). 1.0 when no projection is related so."""
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


def _keywords(module: nn.Module) -> set[str]:
    """The keywords the module's forward takes; ``TypeError`` for a required one the check cannot build."""
    params = list(inspect.signature(module.forward).parameters.values())
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = [p.name for p in params[1:] if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in _SUPPLIED]
    if required:
        raise TypeError(f"{type(module).__name__}.forward needs {required}, which headwise.check cannot build; "
                        f"it supplies hidden_states and {sorted(_SUPPLIED)}")
    return named
