"""Adapters for Hugging Face attention modules (BERT, GPT-2, Llama family), wrapped as they are.

Each module is called the way its model calls it: with an explicit 4-D additive ``attention_mask``
``(b, 1, s_q, s_kv)`` (0 = may attend, ``finfo.min`` = blocked, as the models build it), rotary
``position_embeddings`` from the family's own rotary class (Llama, Mistral, Qwen2, ...), and the library's
``DynamicCache`` for the decode path. Attention weights come from the ``"eager"`` implementation, outputs
from the module's configured one. ``transformers`` is imported only when such a module is checked.

Shapes:
    b: batch, s: tokens, d: hidden size, h: heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Iterator

import torch
from torch import nn

from .adapters import Adapter, capture_input, check_rotary_scaling, copy_adapter, split

__all__ = ["HFAdapter", "BertAdapter", "GPT2Adapter", "LlamaAdapter", "family_adapter", "hf_adapter", "hf_class"]


class HFAdapter(Adapter):
    """Shared machinery; subclasses say where the projections live.

    Shapes:
        run: x (b, s, d), keep (b, s) -> (b, s, d); weights (b, h, s, s)
    """

    accepts_causal = accepts_mask = exposes_weights = exposes_heads = True

    def __init__(self, module: nn.Module, *, causal: bool, name: str | None = None) -> None:
        self.module = module
        self.name = name or type(module).__name__
        self.claims_causal = causal
        self.sinks = isinstance(getattr(module, "sinks", None), torch.Tensor)  # gpt-oss: a sink logit per head
        self.config = module.config if hasattr(module, "config") else self._find_config(module)
        self.window = sliding_window_of(module, self.config)

    @staticmethod
    def _find_config(module: nn.Module) -> Any:
        for sub in module.modules():
            if hasattr(sub, "config"):
                return sub.config
        raise ValueError(f"{type(module).__name__} has no config")

    @property
    def dtype(self):
        return next(self.module.parameters()).dtype

    @property
    def device(self):
        return next(self.module.parameters()).device

    # -- calling ------------------------------------------------------------------------------------
    def _mask(self, b: int, q_pos: torch.Tensor, k_pos: torch.Tensor, keep, causal: bool, dtype,
              device) -> torch.Tensor:
        """The model's additive mask for queries at ``q_pos`` over keys at ``k_pos`` (absolute positions):
        causal (and the layer's sliding window, which HF builds into the mask, not the module), padding."""
        allowed = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool, device=device)
        if causal:
            allowed = k_pos[None, :] <= q_pos[:, None]
            if self.window is not None:
                allowed = allowed & (k_pos[None, :] > q_pos[:, None] - self.window)
        allowed = allowed.expand(b, 1, -1, -1)
        if keep is not None:
            allowed = allowed & keep[:, k_pos][:, None, None, :]
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)

    def _extra(self, x: torch.Tensor, positions: torch.Tensor | None) -> dict[str, Any]:
        return {}

    def _forward(self, x, mask, positions=None, cache=None):
        kw = self._extra(x, positions)
        if cache is not None:
            kw[self._cache_kw()] = cache
        return self.module(x, attention_mask=mask, **kw)

    def _cache_kw(self) -> str:
        params = inspect.signature(self.module.forward).parameters
        return "cache" if "cache" in params else "past_key_values"

    @contextlib.contextmanager
    def _implementation(self, name: str | None) -> Iterator[None]:
        if name is None:
            yield
            return
        old = self.config._attn_implementation
        self.config._attn_implementation = name
        try:
            yield
        finally:
            self.config._attn_implementation = old

    def run(self, x, *, keep=None, causal=None, positions=None):
        causal = self.causal_flag(causal)
        pos = torch.arange(x.shape[1], device=x.device)
        mask = self._mask(x.shape[0], pos, pos, keep, causal, x.dtype, x.device)
        return self._forward(x, mask, positions)[0]

    def run_weights(self, x, *, keep=None, causal=None):
        causal = self.causal_flag(causal)
        pos = torch.arange(x.shape[1], device=x.device)
        mask = self._mask(x.shape[0], pos, pos, keep, causal, x.dtype, x.device)
        with self._implementation("eager"):
            y, w = self._forward(x, mask)[:2]
        return y, w

    def decode(self, x, prefill):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        layer_idx = getattr(self.module, "layer_idx", None) or 0
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

    def contexts(self, x, *, causal=None):
        out_module = self._out_module()
        if out_module is None:  # no W_O in this module: its output is the merged contexts
            return split(self.run(x, causal=causal), self.n_heads)
        with capture_input(out_module) as got:
            self.run(x, causal=causal)
        return split(got[0], self.n_heads)  # (b, h, s, d_h)

    def converted(self, dtype):
        new = copy_adapter(self, dtype)
        new.config = new.module.config if hasattr(new.module, "config") else self._find_config(new.module)
        if new.config._attn_implementation is None:  # a module built outside a model: what HF falls back to
            new.config._attn_implementation = "eager"
        return new

    def _out_module(self) -> nn.Module | None:
        raise NotImplementedError


class BertAdapter(HFAdapter):
    """``BertSelfAttention`` (no W_O: the output is the merged heads) or ``BertAttention`` (self-attention,
    then ``output.dense`` = W_O, dropout, residual and LayerNorm, all per token)."""

    def __init__(self, module, *, causal=False, name=None):
        super().__init__(module, causal=causal, name=name)
        self.core = module.self if hasattr(module, "self") else module
        self.d_model = self.core.query.in_features
        self.n_heads = self.n_kv_heads = self.core.num_attention_heads
        self.d_head = self.core.attention_head_size

    def _out_module(self):
        return self.module.output.dense if hasattr(self.module, "output") else None

    def qk(self, x):
        return split(self.core.query(x), self.n_heads), split(self.core.key(x), self.n_heads)

    def head_slices(self, which, index):
        lin = {"q": self.core.query, "k": self.core.key, "v": self.core.value}[which]
        lo, hi = index * self.d_head, (index + 1) * self.d_head
        return [(lin.weight, 0, lo, hi)] + ([(lin.bias, 0, lo, hi)] if lin.bias is not None else [])

    def converted(self, dtype):
        new = super().converted(dtype)
        new.core = new.module.self if hasattr(new.module, "self") else new.module
        return new

    def decode(self, x, prefill):
        raise NotImplementedError


class GPT2Adapter(HFAdapter):
    """``GPT2Attention``: ``c_attn`` is a Conv1D (weight ``(d, 3 w)``, stored transposed; ``w = split_size``, the
    heads' width: d unless heads were removed), so head ``i``'s W_Q is columns ``i * d_h ..``, W_K columns
    ``w + i * d_h ..``, W_V columns ``2 w + i * d_h ..``."""

    has_cache = True

    def __init__(self, module, *, causal=True, name=None):
        super().__init__(module, causal=causal, name=name)
        if getattr(module, "is_cross_attention", False):
            raise ValueError("GPT2Adapter checks self-attention; got a cross-attention GPT2Attention")
        self.d_model = module.embed_dim
        self.n_heads = self.n_kv_heads = module.num_heads
        self.d_head = module.head_dim
        self.width = module.split_size  # h * d_h: what GPT-2's forward splits c_attn at

    def _out_module(self):
        return self.module.c_proj

    def qk(self, x):
        q, k, _ = self.module.c_attn(x).split(self.width, dim=2)
        return split(q, self.n_heads), split(k, self.n_heads)

    def head_slices(self, which, index):
        c = self.module.c_attn
        lo = {"q": 0, "k": self.width, "v": 2 * self.width}[which] + index * self.d_head
        return [(c.weight, 1, lo, lo + self.d_head), (c.bias, 0, lo, lo + self.d_head)]


class LlamaAdapter(HFAdapter):
    """``LlamaAttention`` and the families that reuse it (Mistral, Qwen2, ...): GQA and rotary position
    embeddings built by the family's own rotary class; permutation checks move positions with tokens."""

    has_cache = True
    positional = True
    precision = torch.float32  # the family's eager softmax runs in float32 whatever the input dtype

    def __init__(self, module, *, causal=True, name=None):
        super().__init__(module, causal=causal, name=name)
        cfg = self.config
        self.d_model = module.q_proj.in_features
        self.d_head = module.head_dim
        self.n_heads = module.q_proj.out_features // self.d_head
        self.n_kv_heads = module.k_proj.out_features // self.d_head
        family = sys.modules[hf_class(module).__module__]  # the family's own module, also when patched
        rope_cls = [getattr(family, n) for n in dir(family) if n.endswith("RotaryEmbedding")
                    and isinstance(getattr(family, n), type)]
        if not rope_cls or not hasattr(family, "apply_rotary_pos_emb"):
            raise ValueError(f"{type(module).__name__}: cannot find the family's rotary embedding")
        self._apply_rotary = family.apply_rotary_pos_emb
        self.rope = rope_cls[0](config=cfg).to(self.device)
        check_rotary_scaling(self.rope, self.name)
        # a patched module rotates with its headwise layer when the model passes no position_embeddings
        check_rotary_scaling(getattr(getattr(module, "attn", None), "rotary", None), self.name)

    def _position_embeddings(self, x, positions):
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        position_ids = positions.expand(x.shape[0], -1) if positions.dim() == 1 else positions
        return self.rope(x, position_ids)

    def _extra(self, x, positions):
        return {"position_embeddings": self._position_embeddings(x, positions)}

    def _out_module(self):
        return self.module.o_proj

    def qk(self, x):
        q = split(self.module.q_proj(x), self.n_heads)  # (b, h, s, d_h)
        k = split(self.module.k_proj(x), self.n_kv_heads)  # (b, h_kv, s, d_h)
        q_norm, k_norm = getattr(self.module, "q_norm", None), getattr(self.module, "k_norm", None)
        if q_norm is not None and k_norm is not None:  # Qwen3: RMSNorm of each head's q and k before rotary
            q, k = q_norm(q), k_norm(k)
        cos, sin = self._position_embeddings(x, None)
        return self._apply_rotary(q, k, cos, sin)

    def head_slices(self, which, index):
        lin = {"q": self.module.q_proj, "k": self.module.k_proj, "v": self.module.v_proj}[which]
        lo, hi = index * self.d_head, (index + 1) * self.d_head
        return [(lin.weight, 0, lo, hi)] + ([(lin.bias, 0, lo, hi)] if lin.bias is not None else [])

    def converted(self, dtype):
        new = super().converted(dtype)
        new.rope = type(self.rope)(config=new.config).to(new.device)
        return new


def sliding_window_of(module: nn.Module, config: Any) -> int | None:
    """The sliding window the model's mask gives this layer, or None (full causal attention): the module's
    own ``sliding_window`` where it has one (Qwen2-style, None on full layers), else the config's, unless
    ``config.layer_types`` says this layer is not a sliding one (Mistral: every layer slides)."""
    if "sliding_window" in vars(module) or hasattr(type(module), "sliding_window"):
        window = getattr(module, "sliding_window")
    else:
        window = getattr(config, "sliding_window", None)
        types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
        if isinstance(types, (list, tuple)) and isinstance(index, int) and index < len(types) \
                and types[index] != "sliding_attention":
            window = None
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def hf_class(module: nn.Module) -> type | None:
    """The first Hugging Face class of ``module``'s class hierarchy (itself, or the original class of a module
    patched by :func:`headwise.interop.patch`), or None when it is not a transformers module."""
    return next((c for c in type(module).__mro__ if c.__module__.startswith("transformers.")), None)


_BERT = ("BertSelfAttention", "BertAttention", "RobertaSelfAttention", "RobertaAttention")
_GPT2 = ("GPT2Attention",)


def family_adapter(module: nn.Module) -> type[HFAdapter] | None:
    """The family adapter class for a Hugging Face attention module (BERT-, GPT-2- or Llama-style, by its class
    and layout), or None.

    Shapes:
        module: hidden states (b, s, d) -> (b, s, d).
    """
    cls = hf_class(module)
    name = cls.__name__ if cls is not None else ""  # a patched module keeps its HF class as a base
    if name in _BERT:
        return BertAdapter
    if name in _GPT2:
        return GPT2Adapter
    if all(isinstance(getattr(module, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) \
            and hasattr(module, "head_dim") and "position_embeddings" in inspect.signature(module.forward).parameters:
        return LlamaAdapter
    return None


def hf_adapter(module: nn.Module, *, causal: bool | None = None) -> HFAdapter:
    """The family adapter for a Hugging Face attention module (:func:`family_adapter`); anything else raises
    ``TypeError`` naming the supported classes.

    Shapes:
        module: hidden states (b, s, d) -> (b, s, d).
    """
    found = family_adapter(module)
    if found is BertAdapter:
        return BertAdapter(module, causal=bool(causal))
    if found is not None:
        return found(module, causal=True if causal is None else causal)
    raise TypeError(f"no headwise.check adapter for Hugging Face module {hf_class(module).__name__}; supported: BERT "
                    f"({', '.join(_BERT)}), GPT-2 ({', '.join(_GPT2)}), Llama-style attention with "
                    "q_proj/k_proj/v_proj/o_proj and position_embeddings (Llama, Mistral, Qwen2, ...), and any "
                    "self-attention module calling transformers' attention interface (ALL_ATTENTION_FUNCTIONS)")
