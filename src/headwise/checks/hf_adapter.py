"""The adapter for a Hugging Face attention module: any module that calls transformers' attention interface
(BERT, GPT-2, Llama, OPT, Phi-3, GPT-NeoX, Gemma 2 and 3, DeepSeek-V3, ViT, ...), unpatched, patched by
:func:`headwise.interop.patch`, its layer from :func:`headwise.interop.layers`, or the block that holds one and its
W_O (BERT's ``BertAttention``).

Such a module projects, normalises and rotates its own Q/K/V, then calls the function registered for its
``config._attn_implementation`` in ``ALL_ATTENTION_FUNCTIONS``. :class:`HFAdapter` calls the module the way its
model does, whatever its forward's keywords: the 4-D mask (``attention_mask``, or T5's ``mask``) in the form its
implementation's mask function builds (bool, True = may attend, for ``"headwise"`` and ``"sdpa"``; additive
``finfo.min`` for ``"eager"``; with the layer's sliding window or Llama 4 chunk), the rotary
``(cos, sin)`` from the family's own rotary class (with the layer's type where it takes one: Gemma 3),
``position_ids`` / ``cache_position`` where it takes them, and the library's ``DynamicCache`` for the decode path.
Attention weights, the q / k the scores see, the values and the contexts made of them are read at the seam: for one
call the module's implementation is a thin wrapper (registered in the local mapping of the interface its family's
forward reads, removed afterwards) around the family's eager function, or around headwise's when the module runs
headwise (patched). A scale the module folds into q or k before the call is found and counted in; the scale and
softcap the family declares in its config are what the scores are checked against
(:func:`~headwise.checks.hf_module.declared`).

Heads come from the module's :class:`~headwise.interop.hf.layer.HFView` (where the registry locates Q/K/V and W_O):
head ``i``'s W_Q rows are ``view.head(i).w_q``. Where they are not located (multi-head latent attention, CodeGen's
sharded ``qkv_proj``), head independence is not applicable and says why.

Shapes:
    b: batch, s: tokens, d: model width, h: query heads, h_kv: key/value heads, d_h: value head width,
    d_qk: query/key head width. run: x (b, s, d) -> (b, s, d); weights (b, h, s, s); values (b, h_kv, s, d_h);
    contexts (b, h, s, d_h); position_bias (1, h, s, s).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Iterator

import torch
from torch import nn

from ..interop.hf import HFView
from ..interop.hf.attention_function import NAME as HEADWISE
from ..interop.hf.layer import family_entry, view_of
from ..interop.hf.registry import sliding_window_of
from .adapters import Adapter, NotExposed, capture_input, check_rotary_scaling, copy_adapter, split
from .hf_module import CACHE_KW, MASK_KW, attention_of, chunk_of, cross_reason, declared, folded_scale, hf_class, \
    keywords, relative_bias

__all__ = ["HFAdapter"]

# The implementation name the check's wrapper is registered under, for the length of one call.
_KEY = "headwise_check"


class HFAdapter(Adapter):
    """``headwise.check`` on a Hugging Face attention module (see the module docstring for the forms it takes).

    ``causal=None``: the module's own ``is_causal`` (else its config's ``is_decoder``); a sliding window from the
    config (:func:`~headwise.interop.hf.registry.sliding_window_of`). Raises ``TypeError`` for a module that is
    not on the interface or a forward needing inputs the adapter cannot build, ``ValueError`` for
    cross-attention, a causal module whose forward takes no mask, or a rotary module whose family has no rotary
    class.

    Shapes:
        module: hidden_states (b, s, d) -> (b, s, d)

    Example:
        >>> import transformers
        >>> cfg = transformers.OPTConfig(vocab_size=32, hidden_size=16, num_attention_heads=4, ffn_dim=32,
        ...                              num_hidden_layers=1, word_embed_proj_dim=16)
        >>> module = transformers.OPTForCausalLM(cfg).model.decoder.layers[0].self_attn
        >>> ad = HFAdapter(module)
        >>> ad.claims_causal, ad.exposes_heads, (ad.n_heads, ad.d_head)
        (True, True, (4, 4))
    """

    precision = torch.float32  # the families' eager softmax runs in float32 whatever the input dtype
    accepts_causal = accepts_mask = exposes_weights = True
    seam_impl: str | None = None

    def __init__(self, module: nn.Module, *, causal: bool | None = None, name: str | None = None) -> None:
        given = module.host if isinstance(module, HFView) else None
        where = name or (module.host_name if isinstance(module, HFView) else "") or ""
        module = given if given is not None else module
        attention = attention_of(module)
        if attention is None:
            raise TypeError(f"no headwise.check adapter for Hugging Face module {type(module).__name__}: it checks "
                            "modules that call transformers' attention interface (ALL_ATTENTION_FUNCTIONS), or a "
                            "block holding one of them and its W_O")
        self.module, self.attention = module, attention
        self.name = name or hf_class(module).__name__
        self.config = attention.config
        self.params = keywords(module)
        why = cross_reason(attention, self.params, where, causal)
        if why:
            raise ValueError(f"{type(attention).__name__}{f' at {where!r}' if where else ''} is cross-attention "
                             f"({why}): headwise.check checks self-attention, whose keys and values come from its "
                             "own input")
        self.sinks = isinstance(getattr(attention, "sinks", None), torch.Tensor)  # gpt-oss: a sink logit per head
        self.window = sliding_window_of(attention, self.config)
        self.chunk = chunk_of(attention, self.config)
        if self.window is None and self.chunk is not None:
            # a chunked query reads at most chunk - 1 keys back: a window bound for the properties, which the
            # mask then narrows to the query's chunk
            self.window = self.chunk
        self.scale, self.scale_source, self.softcap = declared(attention, self.config)
        self.claims_causal = self._own_claim() if causal is None else bool(causal)
        self.mask_kw = next((k for k in MASK_KW if k in self.params), None)
        self.accepts_mask = self.accepts_causal = self.mask_kw is not None
        if self.claims_causal and not self.accepts_mask:
            raise ValueError(f"{self.name} is causal, but its forward takes no mask ({' or '.join(MASK_KW)}) to "
                             "run it causally with: headwise.check cannot run it as its model does")
        cache_kw = [k for k in CACHE_KW if k in self.params]
        self.cache_kw = cache_kw[0] if cache_kw else None
        self.has_cache = self.cache_kw is not None and isinstance(getattr(attention, "layer_idx", None), int) \
            and self.accepts_mask
        self.rope = self._rotary() if "position_embeddings" in self.params else None
        self.positional = self.rope is not None or "position_ids" in self.params
        self._bind()

    def _own_claim(self) -> bool:
        """Causal when the module says so, or is a decoder's (self-attention) module: some (BigBird-Pegasus) leave
        ``is_causal`` False and rely on the model's causal mask."""
        m = self.attention
        return getattr(m, "is_causal", None) is True or getattr(m, "is_decoder", None) is True \
            or (getattr(m, "is_causal", None) is None and getattr(self.config, "is_decoder", False) is True)

    def _rotary(self) -> nn.Module:
        """The family's rotary embedding (the class the model builds: ``<Family>RotaryEmbedding``)."""
        cls = hf_class(self.attention)
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

    def _bind(self) -> None:
        """Sizes and heads from the module's view (rebuilt for each copy: it follows its own module)."""
        parent = self.module if self.module is not self.attention else None
        self.view = view = view_of(self.attention, parent)
        cfg = view.config
        self.d_model, self.n_heads, self.n_kv_heads, self.d_head = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, \
            cfg.d_head
        located = view.located
        why = located["q_proj"] or located["k_proj"] or located["v_proj"]
        self.out = None
        if not why and not located["out_proj"]:
            self.out = view.projection("out_proj").module()  # the module itself (a Conv1D too): its input is z
            if not any(m is self.out for m in self.module.modules()):
                why = f"its W_O ({type(self.out).__name__}) is outside the module"
        elif not why:
            inside = [n for n in family_entry(self.attention).o if isinstance(getattr(self.attention, n, None),
                                                                             nn.Module)]
            if inside:  # an output projection the registry could not match: its input is not known to be heads
                why = f"W_O is not located ({located['out_proj']})"
        self.exposes_heads = not why
        # Without its W_O (BERT's self-attention) the module returns the merged heads: h * d_h wide, which head
        # pruning makes narrower than d_model
        self.d_out = cfg.n_heads * cfg.d_head if not why and self.out is None else None
        self.no_heads_reason = f"{self.name} exposes no heads: {why}" if why else ""

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    # -- calling ------------------------------------------------------------------------------------
    def _impl(self) -> str:
        impl = self.config._attn_implementation
        return impl if impl in ("eager", "sdpa", HEADWISE) else "eager"

    def _mask(self, b: int, q_pos: torch.Tensor, k_pos: torch.Tensor, keep: torch.Tensor | None, causal: bool,
              dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The model's mask for queries at ``q_pos`` over keys at ``k_pos`` (absolute positions): causal (and the
        layer's sliding window or chunk, which HF builds into the mask, not the module), padding; additive
        ``finfo.min`` for eager, bool (True = may attend) for the others."""
        allowed = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool, device=device)
        if causal:
            allowed = k_pos[None, :] <= q_pos[:, None]
            if self.window is not None:
                allowed = allowed & (k_pos[None, :] > q_pos[:, None] - self.window)
        allowed = allowed.expand(b, 1, -1, -1)
        if causal and self.chunk is not None:
            # chunks start at each sample's first real token, as transformers' chunked mask counts them
            left = torch.zeros(b, 1, 1, 1, dtype=torch.long, device=device) if keep is None else \
                (keep.long().cumsum(-1) == 0).sum(-1).view(b, 1, 1, 1)
            allowed = allowed & ((k_pos[None, :] - left) // self.chunk == (q_pos[:, None] - left) // self.chunk)
        if keep is not None:
            allowed = allowed & keep[:, k_pos][:, None, None, :]
        if (self.seam_impl or self._impl()) != "eager":
            return allowed  # what transformers' sdpa_mask (and headwise's) build
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)

    def _position_embeddings(self, x: torch.Tensor, positions: torch.Tensor) -> Any:
        position_ids = positions.expand(x.shape[0], -1) if positions.dim() == 1 else positions
        if "layer_type" in inspect.signature(self.rope.forward).parameters:
            types, index = getattr(self.config, "layer_types", None), getattr(self.attention, "layer_idx", None)
            kind = types[index] if isinstance(types, (list, tuple)) and isinstance(index, int) else None
            return self.rope(x, position_ids, kind)
        return self.rope(x, position_ids)

    def _forward(self, x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor | None = None,
                 cache: Any = None) -> tuple:
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        kw: dict[str, Any] = {}
        if self.mask_kw is not None:
            kw[self.mask_kw] = mask
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
        """For one call, route the module's attention through a wrapper that records (q, k, weights, v, output)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as shared

        family = sys.modules[hf_class(self.attention).__module__]
        functions = getattr(family, "ALL_ATTENTION_FUNCTIONS", shared)  # the mapping its forward reads (Doge: own)
        impl = self._impl()
        if impl == "sdpa" and weights:
            impl = "eager"  # sdpa computes no weights; transformers' own answer is the eager function
        base = getattr(family, "eager_attention_forward", None) if impl == "eager" else functions[impl]
        if base is None:
            raise TypeError(f"{self.name}: its family module has no eager_attention_forward to compute weights with")
        got: list[tuple[torch.Tensor, ...]] = []

        def wrapper(module, query, key, value, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
            if impl == HEADWISE and weights:
                kwargs["output_attentions"] = True
            z, w = base(module, query, key, value, attention_mask, **kwargs)
            got.append((query, key, w, value, z))
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

    def run(self, x, *, keep=None, causal=None, positions=None):  # type: ignore[no-untyped-def]
        if positions is not None and not self.positional:
            raise ValueError(f"{self.name} takes no positions")
        if not self.accepts_mask and (keep is not None or self.causal_flag(causal)):
            raise ValueError(f"{self.name} takes no mask ({' or '.join(MASK_KW)})")
        causal = self.causal_flag(causal)
        pos = torch.arange(x.shape[1], device=x.device)
        return self._forward(x, self._mask(x.shape[0], pos, pos, keep, causal, x.dtype, x.device), positions)[0]

    def run_weights(self, x, *, keep=None, causal=None):  # type: ignore[no-untyped-def]
        causal = self.causal_flag(causal)
        pos = torch.arange(x.shape[1], device=x.device)
        with self._seam(weights=True) as got:
            y = self._forward(x, self._mask(x.shape[0], pos, pos, keep, causal, x.dtype, x.device))[0]
        return y, got[-1][2]

    def decode(self, x, prefill):  # type: ignore[no-untyped-def]
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        layer_idx = getattr(self.attention, "layer_idx", None) or 0
        b, s, _ = x.shape
        steps = []
        for start, stop in [(0, prefill)] + [(t, t + 1) for t in range(prefill, s)]:
            positions = torch.arange(start, stop, device=x.device)
            # the keys the cache will return (a sliding-window cache keeps only the last window - 1)
            kv_length, kv_offset = cache.get_mask_sizes(stop - start, layer_idx)
            k_pos = torch.arange(kv_offset, kv_offset + kv_length, device=x.device)
            mask = self._mask(b, positions, k_pos, None, True, x.dtype, x.device)
            # contiguous: GPT-2 .view()s its projections, which a strided slice of x would break
            steps.append(self._forward(x[:, start:stop].contiguous(), mask, positions, cache=cache)[0])
        return torch.cat(steps, dim=1)

    def qk(self, x):  # type: ignore[no-untyped-def]
        """q and k as the interface gets them (after the module's norms and rotary), with a scale the module folded
        into q or k before the call (OPT, Whisper, ESM multiply q by 1/sqrt(d_qk), OpenAI's privacy filter q and k
        each by d_qk**-0.25, and pass scaling=1) taken back out, so that the fitted scale is the whole scale of the
        scores."""
        pos = torch.arange(x.shape[1], device=x.device)
        outs: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(lambda mod, args, out: outs.append(out)) for m in self.attention.modules()
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

        def unfolded(t: torch.Tensor) -> torch.Tensor:
            found = folded_scale(t, outs)  # 1.0 where no projection's norms match: nothing to take out
            folded = 1.0 if found == 1.0 else found / rotary
            return t if abs(folded - 1) < 1e-4 else t / folded
        return unfolded(q), unfolded(k)

    def values(self, x):  # type: ignore[no-untyped-def]
        """The values the attention function receives at the seam (after whatever the module does to them: its
        projection, a value norm), in the call :meth:`contexts` makes: ``x`` unpadded, causal as the module claims.
        None where heads are not exposed; :class:`~headwise.checks.adapters.NotExposed` saying why where the call
        hands the function no per-K/V-head values."""
        got = self._seam_call(x)
        return None if got is None else got[0]

    def values_and_contexts(self, x):  # type: ignore[no-untyped-def]
        """The values the attention function receives and the contexts it returns, in one normal call (see
        :meth:`values`): the weights and the values meet there, so what the module does to the contexts after it (a
        Qwen3-Next-style output gate before W_O) is not the function's output."""
        return self._seam_call(x)

    def _seam_call(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(values, contexts) at the seam, or None where heads are not exposed.

        Shapes: x (b, s, d) -> (b, h_kv, s, d_h), (b, h, s, d_h)"""
        if not self.exposes_heads:
            return None
        b, s, _ = x.shape
        pos = torch.arange(s, device=x.device)
        with self._seam(weights=False) as got:
            self._forward(x, self._mask(b, pos, pos, None, self.causal_flag(None), x.dtype, x.device))
        if not got:
            raise NotExposed(f"{self.name} never called its attention function, so its values were not seen")
        v, z = got[-1][3], got[-1][4]
        want = (b, self.n_kv_heads, s, self.d_head)  # (b, h_kv, s, d_h)
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != want:
            seen = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise NotExposed(f"{self.name} handed its attention function values of shape {seen}, not (b, h_kv, s, "
                             f"d_h) = {want}")
        out = (b, s, self.n_heads, self.d_head)  # the interface's output layout: (b, s, h, d_h)
        if not isinstance(z, torch.Tensor) or tuple(z.shape) != out:
            seen = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
            raise NotExposed(f"{self.name}'s attention function returned contexts of shape {seen}, not (b, s, h, "
                             f"d_h) = {out}")
        return v, z.transpose(1, 2)  # (b, h, s, d_h)

    def position_bias(self, s):  # type: ignore[no-untyped-def]
        """The T5 family's relative position bias of the attention module itself (not of a block holding it), or
        None."""
        return relative_bias(self.attention, s)

    def contexts(self, x, *, causal=None):  # type: ignore[no-untyped-def]
        if self.out is None:  # W_O is applied by the parent: the module's output is the merged contexts
            return split(self.run(x, causal=causal), self.n_heads)
        with capture_input(self.out) as got:
            self.run(x, causal=causal)
        return split(got[0], self.n_heads)  # (b, h, s, d_h)

    def head_slices(self, which, index):  # type: ignore[no-untyped-def]
        group = self.n_heads // self.n_kv_heads
        head = self.view.head(index if which == "q" else index * group)
        weight, bias = getattr(head, f"w_{which}"), getattr(head, f"b_{which}")  # live views of the module's rows
        return [(weight, 0, 0, weight.shape[0])] + ([] if bias is None else [(bias, 0, 0, bias.shape[0])])

    def converted(self, dtype):  # type: ignore[no-untyped-def]
        new = copy_adapter(self, dtype)
        new.attention = attention_of(new.module)
        new.config = new.attention.config
        if new.config._attn_implementation not in ("sdpa", HEADWISE):  # unset (a module built outside a model),
            new.config._attn_implementation = "eager"  # or a kernel for other hardware: HF's reference function
        if self.rope is not None:
            new.rope = type(self.rope)(config=new.config).to(new.device)
        new._bind()
        return new
