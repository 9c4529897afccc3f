"""The multi-head attention layer: packed projections over independent heads.

``attn(x)`` reads like the seeds: check the inputs once (:func:`headwise.validation.check_forward`), plan the
call once (:func:`headwise.plan.plan_attention`, where every decision is made and explained), then project,
split, rotate, attend (:func:`headwise.functional.attend`), merge and project out. A decode step with a
cache is the same forward: the cache's keys and values join the call's own before attending.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width (d_model), d_h: head width (d_head).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from . import checkpoint
from . import functional as hwf
from .call_plan import explain_forward, plan_attend, plan_forward
from .chunking import forward_in_chunks
from .config import AttentionConfig
from .dispatch import DispatchInfo
from .head import ORIGINAL_HEADS, LayerHeads
from .kv_cache import KVCache
from .module_calls import bare_linear, calls_forward_only, has_forward_hooks  # noqa: F401 (re-exported)
from .plan import CacheRead, Plan, forward_warning
from .rotary import RotaryEmbedding
from .statistics import attend_with_statistics
from .token_step import PLAN_KEY, QUERY_PLAN_KEY, one_query_plan, one_token
from .validation import check_device, check_dtype, check_first_write, check_forward, check_layer_size, check_qkv

__all__ = ["MultiHeadAttention", "calls_forward_only", "has_forward_hooks"]


class MultiHeadAttention(LayerHeads, nn.Module):
    """Multi-head attention (MHA, GQA or MQA) whose heads can be taken out, run alone and put back.

    The per-head matrices W_Q^h, W_K^h, W_V^h (each ``(d_model, d_head)``) are packed into one plain
    ``nn.Linear`` each (``q_proj``, ``k_proj``, ``v_proj``); the split into heads is a view, each head runs
    ``softmax(Q K^T / sqrt(d_head)) V`` independently, and ``out_proj`` (W_O) is the only place where heads
    mix. Under GQA/MQA query head ``i`` reads K/V head ``i // (n_heads // n_kv_heads)``.

    The default backend is PyTorch's fused ``scaled_dot_product_attention`` (native GQA, kernel-side causal
    masking, no materialised probabilities); ``backend="eager"`` (and ``return_weights=True``) runs the
    readable reference that materialises each head's softmax. A query row that may attend to nothing
    yields zeros (and zero weights), never NaN.

    Args:
        d_model: model width d.
        n_heads: query heads h.
        n_kv_heads: key/value heads h_kv (None: = n_heads, MHA; 1: MQA).
        d_head: head width (None: d_model // n_heads, which must then divide exactly).
        bias: biases on the Q, K, V projections (and on W_O unless ``out_bias`` says otherwise).
        out_bias: bias on W_O (None: same as ``bias``).
        dropout: dropout on attention probabilities, in training mode only.
        kdim, vdim: widths of separate key / value inputs (None: d_model).
        scale: score scale (None: 1 / sqrt(d_head)).
        rotary: an optional :class:`RotaryEmbedding` applied to Q and K of every head.
        backend: ``"sdpa"`` (default) or ``"eager"``.
        config: an :class:`AttentionConfig` instead of the fields above (pass one or the other).
        device, dtype: of the parameters (dtype must be floating).

    Shapes:
        x: (b, s_q, d) or (s_q, d) -> (b, s_q, d) or (s_q, d)
        context: (b, s_kv, d); key: (b, s_kv, kdim); value: (b, s_kv, vdim)
        mask: bool (True = may attend) or float (added to scores), broadcastable to (b, h, s_q, s_kv)
        weights (with return_weights=True): (b, h, s_q, s_kv), one softmax per head, never averaged

    Example:
        >>> attn = MultiHeadAttention(d_model=64, n_heads=8, n_kv_heads=2)
        >>> x = torch.randn(2, 5, 64)
        >>> y, w = attn(x, return_weights=True)
        >>> y.shape, w.shape
        (torch.Size([2, 5, 64]), torch.Size([2, 8, 5, 5]))
        >>> heads = torch.cat([attn.head(i)(x) for i in range(8)], dim=-1)   # every head alone...
        >>> torch.testing.assert_close(attn.out_proj(heads), y)               # ...then W_O: the same layer
    """

    #: While a :func:`headwise.trace` is active, the object that captures and edits this layer's heads:
    #: ``wants_weights(layer)``, ``qkv(layer, q, k, v, cached)``, ``context(layer, z, weights) -> z`` and
    #: ``results(layer) -> (b, s_q, h, d) or None`` (every head's write z_h W_O^h, when it computed them)
    #: are called at those steps of the forward; ``wants_statistics(layer)`` (names from
    #: :data:`headwise.plan.STATISTICS`) and ``statistics(layer, values)`` when a trace asks for per-head
    #: statistics (:mod:`headwise.statistics`). None (the default) costs one check.
    tracer = None

    def __init__(
        self, d_model: int | None = None, n_heads: int | None = None, n_kv_heads: int | None = None, *,
        d_head: int | None = None, bias: bool = True, out_bias: bool | None = None, dropout: float = 0.0,
        kdim: int | None = None, vdim: int | None = None, scale: float | None = None,
        rotary: RotaryEmbedding | None = None, backend: str = "sdpa", config: AttentionConfig | None = None,
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if config is None:
            config = AttentionConfig(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head,
                                     bias=bias, out_bias=out_bias, dropout=dropout, kdim=kdim, vdim=vdim,
                                     scale=scale)
        elif not isinstance(config, AttentionConfig):
            raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
        elif (d_model, n_heads, n_kv_heads, d_head, kdim, vdim, scale, out_bias) != (None,) * 8 \
                or (bias, dropout) != (True, 0.0):
            raise ValueError("pass either config= or the individual fields (d_model, n_heads, ...), not both")
        if rotary is not None:
            if not isinstance(rotary, RotaryEmbedding):
                raise TypeError(f"rotary must be a RotaryEmbedding, got {type(rotary).__name__}")
            if rotary.d_head != config.d_head:
                raise ValueError(f"rotary was built for d_head={rotary.d_head}, the layer has d_head={config.d_head}")
        check_dtype("dtype", dtype)
        check_device("device", device)
        check_layer_size(config, dtype, device)  # before nn.Linear allocates
        self.config = config
        self.backend = backend
        self.q_proj = nn.Linear(config.d_model, config.inner_dim, bias=config.bias, device=device, dtype=dtype)
        self.k_proj = nn.Linear(config.kdim, config.kv_dim, bias=config.bias, device=device, dtype=dtype)
        self.v_proj = nn.Linear(config.vdim, config.kv_dim, bias=config.bias, device=device, dtype=dtype)
        self.out_proj = nn.Linear(config.inner_dim, config.d_model, bias=config.out_bias, device=device, dtype=dtype)
        self.rotary = rotary
        self._chunk_queries: bool | int = True

    @classmethod
    def from_config(cls, config: AttentionConfig, **kwargs) -> "MultiHeadAttention":  # type: ignore[no-untyped-def]
        """``MultiHeadAttention(config=config, **kwargs)`` (rotary, backend, device, dtype).

        Example:
            >>> cfg = AttentionConfig(d_model=32, n_heads=4, kdim=16, vdim=24, out_bias=False)
            >>> attn = MultiHeadAttention.from_config(cfg)
            >>> attn(torch.randn(2, 3, 32), key=torch.randn(2, 7, 16), value=torch.randn(2, 7, 24)).shape
            torch.Size([2, 3, 32])
        """
        return cls(config=config, **kwargs)

    # -- sizes --------------------------------------------------------------------------------------------
    d_model = property(lambda self: self.config.d_model, doc="Model width d.")
    n_heads = property(lambda self: self.config.n_heads, doc="Query heads h.")
    n_kv_heads = property(lambda self: self.config.n_kv_heads, doc="Key/value heads h_kv.")
    d_head = property(lambda self: self.config.d_head, doc="Head width d_h.")

    @property
    def backend(self) -> str:
        """``"sdpa"`` (fused, the default) or ``"eager"`` (the reference; materialises every head's weights).
        Checked whenever it is set."""
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        if value not in hwf.available_backends():
            raise ValueError(f"backend must be one of {hwf.available_backends()}, got {value!r}")
        self._backend = value

    @property
    def chunk_queries(self) -> bool | int:
        """Long no-grad forwards run their queries in chunks (:mod:`headwise.chunking`): True (by size, the
        default), False (never) or an int (that many query positions per chunk whenever chunking is allowed).
        A layer whose ``q_proj`` or ``out_proj`` has forward hooks is never chunked: the hooks see every row once."""
        return self._chunk_queries

    @chunk_queries.setter
    def chunk_queries(self, value: bool | int) -> None:
        if not isinstance(value, int) or (not isinstance(value, bool) and value <= 0):
            raise TypeError(f"chunk_queries must be True, False or a positive int, got {value!r}")
        self._chunk_queries = value

    # -- the forward, in composable steps -----------------------------------------------------------------
    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """Queries of every head. Shapes: x (b, s_q, d) -> (b, h, s_q, d_h)."""
        return hwf.split_heads(self.q_proj(x), self.config.n_heads)  # (b, h, s_q, d_h)

    def project_kv(self, key: torch.Tensor, value: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every K/V head. Shapes: key (b, s_kv, kdim), value (b, s_kv, vdim)
        -> (b, h_kv, s_kv, d_h) each."""
        value = key if value is None else value
        k = hwf.split_heads(self.k_proj(key), self.config.n_kv_heads)  # (b, h_kv, s_kv, d_h)
        v = hwf.split_heads(self.v_proj(value), self.config.n_kv_heads)  # (b, h_kv, s_kv, d_h)
        return k, v

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Self-attention's queries, keys and values: the three projections, each split into heads.

        Shapes: x (b, s, d) -> (b, h, s, d_h), (b, h_kv, s, d_h), (b, h_kv, s, d_h)"""
        cfg = self.config
        q = hwf.split_heads(self.q_proj(x), cfg.n_heads)  # (b, h, s, d_h)
        k = hwf.split_heads(self.k_proj(x), cfg.n_kv_heads)  # (b, h_kv, s, d_h)
        v = hwf.split_heads(self.v_proj(x), cfg.n_kv_heads)  # (b, h_kv, s, d_h)
        return q, k, v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
        causal: bool = False, return_weights: bool = False, scale: float | None = None, softcap: float | None = None,
        sinks: torch.Tensor | None = None, dropout: float | None = None, head_scale: torch.Tensor | None = None,
        plan: Plan | None = None, cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-head attention on already split heads: the one step a :func:`headwise.trace` sees and edits.

        :meth:`forward` calls it, and so does every patched Hugging Face module (through its attention function),
        so a trace sees ``q, k, v`` as given here (and may replace them), then the context and weights (and may
        edit the context) the same way everywhere.

        Called directly, it checks its inputs (q, k, v agree; the mask broadcasts; a sequence-parallel rank hands
        over its own heads) and plans the call; ``forward`` hands over its own ``plan`` (made on inputs it checked)
        and ``cache`` (joined after the trace's edits, rolled back if the step fails).

        Args:
            q, k, v: the split heads (after rotary).
            mask: bool (True = may attend) or floating (added to the scores), broadcastable to (b, h, s_q, s_kv).
            causal: bottom-right causal masking.
            return_weights: also return every head's probabilities (the eager path; after dropout in training).
            scale: score scale (None: the layer's).
            softcap: bound the scores with ``softcap * tanh(score / softcap)`` (Gemma 2).
            sinks: an extra logit per query row that takes probability and carries no value (``(h,)`` or
                ``(b or 1, h, s_q or 1, 1)``).
            dropout: dropout on the probabilities (None: the layer's, in training mode only).
            head_scale: a factor per head ``(h,)`` applied to its probabilities and context (Hugging Face's
                ``head_mask``).
            plan: :meth:`forward`'s plan of this call (its inputs already checked).
            cache: :meth:`forward`'s KV cache (self-attention), joined after the trace sees this call's k, v.

        Shapes:
            q: (b, h, s_q, d_qk); k: (b, h_kv, s_kv, d_qk); v: (b, h_kv, s_kv, d_h) -> (b, h, s_q, d_h),
            weights (b, h, s_q, s_kv) or None
        """
        tracer = self.tracer  # a headwise.trace (None outside one)
        if plan is None:
            if cache is not None:  # the keys a call reads from a cache are planned by forward, with the cache
                raise ValueError("attend: cache is forward's own argument, given with its plan; decode with "
                                 "attn(x, cache=cache), or join cached keys to k and v before calling attend")
            check_qkv(q, k, v)
            if tracer is None and mask is None and return_weights is False and sinks is None and softcap is None \
                    and head_scale is None:
                plan = one_query_plan(self, q, k, v, causal, scale, dropout)  # a decoding loop's step, planned once
        if plan is None:
            plan, mask = plan_attend(self, q, k, v, mask=mask, causal=causal, return_weights=return_weights,
                                     scale=scale, softcap=softcap, sinks=sinks, dropout=dropout,
                                     head_scale=head_scale, tracer=tracer, backend=self._backend)
        if tracer is not None:
            q, k, v = tracer.qkv(self, q, k, v, cache is not None)
        start, room = 0, None
        if cache is not None:  # the plan says which keys the call reads (headwise.plan, rule 8)
            if plan.cache_read is CacheRead.POSITION:  # compiled: written at the device position
                start = cache.mark()  # tensors: no host read in a compiled step
                k, v, mask, room = cache.write_static(k, v, q.requires_grad)  # (.., max_len, ..), (1, 1, s_q, max_len)
            else:
                start = cache.length
                k, v = cache.update(k, v)  # (b, h_kv, length, d_h): everything cached so far
                if plan.cache_read is CacheRead.BUFFER:  # the whole buffer: one shape at every position
                    k, v, mask = cache.keys, cache.values, cache.read_mask(q.shape[2])  # (.., max_len, ..)
                elif q.requires_grad and not (k.requires_grad or v.requires_grad):
                    # Autograd saves what it reads; views of the buffers would change under the next write.
                    k, v = k.clone(), v.clone()
        try:
            if plan.statistics:  # a trace asked for per-head statistics (headwise.plan, rule 10)
                z, weights, values = attend_with_statistics(plan, q, k, v, mask, sinks)  # (b, h, s_q, d_h)
                tracer.statistics(self, values)
            else:
                z, weights = hwf.attend(plan, q, k, v, mask, sinks)  # (b, h, s_q, d_h)
            if room is not None:  # a compiled step the cache had no room for: refused, a zero context
                z = torch.where(room, z, 0.0)
            if head_scale is not None:
                scale_h = head_scale.to(z.dtype).view(1, -1, 1, 1)  # (1, h, 1, 1)
                z, weights = z * scale_h, None if weights is None else weights * scale_h
            if tracer is not None:
                z, weights = tracer.context(self, z, weights)  # a pattern edit: the weights z was made of
        except BaseException:
            # A failed step after the cache write rolls the cache back to the length it had: the positions
            # it reads are exactly as before (the write's slots are zeroed past the length, as a new cache's).
            if cache is not None:  # a compiled step rewinds on the device, reading nothing back
                cache.crop(start) if room is None else cache.rewind(start)
            raise
        return z, weights if return_weights is True else None

    def project_out(self, z: torch.Tensor, results: torch.Tensor | None = None) -> torch.Tensor:
        """Merge heads and apply W_O, the only place heads mix.

        ``results``, every head's write ``z_h W_O^h`` already computed (a trace capturing them), make the
        output their sum plus the bias: the same value without a second product over W_O. They are used only
        while ``out_proj`` is a plain ``nn.Linear`` without hooks (a hook or an adapter on W_O must run, so
        it gets the module call).

        Shapes: z (b, h, s_q, d_h); results (b, s_q, h, d) -> (b, s_q, d)
        """
        out = self.out_proj
        if results is not None and bare_linear(out):
            # Accumulated in float32, as W_O's own product accumulates: a half-precision sum of h rounded writes
            # would drift from the untraced output.
            y = results.sum(2, dtype=torch.promote_types(results.dtype, torch.float32)).to(results.dtype)  # (b, s_q, d)
            return y if out.bias is None else y + out.bias
        return out(hwf.merge_heads(z))  # (b, s_q, d)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding of Q and K at ``positions`` (identity without rotary).

        Shapes: q (b, h, s, d_h), k (b, h_kv, s, d_h), positions (s,) or (b, s) -> q, k"""
        return (q, k) if self.rotary is None else self.rotary.rotate(q, k, positions)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor | None = None, *, key: torch.Tensor | None = None,
        value: torch.Tensor | None = None, mask: torch.Tensor | None = None, causal: bool = False,
        cache: KVCache | None = None, positions: torch.Tensor | None = None, return_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``x`` to itself, to ``context``, or to separate ``key``/``value`` inputs.

        Args:
            x: the queries' inputs.
            context: inputs of keys and values (cross-attention); None: ``x`` itself.
            key, value: separate key and value inputs (widths kdim, vdim); pass both or neither.
            mask: bool (True = may attend) or floating (added to the scores).
            causal: bottom-right causal masking (query i sits at position s_kv - s_q + i).
            cache: a :class:`KVCache` (self-attention): new keys/values are appended and ``x`` attends
                causally over everything cached, so prefill-then-decode equals one causal pass. If the call
                fails, the cache's length and every position it reads are as before.
            positions: rotary positions (rotary layers only); default ``cache.length + arange(s_q)`` (from 0
                without a cache).
            return_weights: also return every head's probabilities (the eager path; after dropout in training).
                With a cache under ``torch.compile`` they span the cache's whole buffer, (b, h, s_q, max_len),
                zero past the written positions (one graph serves every position); eagerly (b, h, s_q, length).
                So do a trace's ``pattern`` and ``key_weight`` ((b, h, max_len)) captured in such a call.

        Shapes:
            x: (b, s_q, d) or (s_q, d); context: (b, s_kv, d); key: (b, s_kv, kdim); value: (b, s_kv, vdim)
            mask: broadcastable to (b, h, s_q, s_kv); positions: (s_q,) or (b, s_q)
            -> (b, s_q, d) [, weights (b, h, s_q, s_kv)]
        """
        if cache is not None and type(self) is MultiHeadAttention and context is None and key is None \
                and value is None and mask is None and positions is None and return_weights is False \
                and (causal is False or causal is True):
            y = one_token(self, x, cache)  # a decode step's short route, or None
            if y is not None:
                return y
        w = self.q_proj.weight
        x, key, value, mask, positions, batched = check_forward(
            self.config, w.dtype, w.device, self.rotary is not None, x, context, key, value, mask, causal, cache,
            positions, return_weights)
        if cache is not None and cache.owner is not self:  # after every check: a refused call never binds a cache
            if cache.owner is None:
                check_first_write(cache, x.shape[1], w.dtype, w.device)  # what the write would refuse
            cache.claim(self)
        tracer = self.tracer  # headwise.trace: capture and edit (None outside a trace); the plan allows for it
        plan = plan_forward(self, x, key, mask, causal, cache, return_weights, backend=self._backend,
                           chunk_queries=self._chunk_queries, value=value)
        if plan.warn:
            warnings.warn(forward_warning(plan), stacklevel=2)
        if self.rotary is not None and positions is None:  # the next positions: after the cache's, or from 0
            start = 0 if cache is None else (cache.position if plan.cache_read is CacheRead.POSITION else cache.length)
            positions = start + torch.arange(x.shape[1], device=x.device)  # (s_q,)
        if plan.chunk is not None:
            with torch.no_grad():
                y = forward_in_chunks(self, plan, x, key, value, mask, positions)
            return y if batched else y.squeeze(0)
        # Project and split: (b, h, s_q, d_h) queries; (b, h_kv, s_kv, d_h) keys and values.
        q, k, v = self.project_qkv(x) if key is None else (self.project_q(x), *self.project_kv(key, value))
        if self.rotary is not None:
            q, k = self.rotary.rotate(q, k, positions)
        # The length a failed call puts back (a compiled step's: the device position, never read on the host).
        start = None if cache is None else \
            cache.mark() if plan.cache_read is CacheRead.POSITION else cache.length
        # Attend: every head on its own (the step a trace sees), over the cache's positions too when there is one.
        z, weights = self.attend(q, k, v, mask=mask, return_weights=True, plan=plan, cache=cache)  # (b, h, s_q, d_h)
        del q, k, v  # without autograd, freed before W_O allocates the output
        # Merge and project out: W_O is the only place heads mix.
        try:
            y = self.project_out(z, None if tracer is None else tracer.results(self))  # (b, s_q, d)
        except BaseException:  # a hook, an edit of the results or W_O failed after the cache write
            if start is not None:
                cache.rewind(start) if isinstance(start, tuple) else cache.crop(start)
            if tracer is not None:  # the trace keeps completed calls only, as the cache does
                tracer.discard(self)
            raise
        if not batched:
            y, weights = y.squeeze(0), None if weights is None else weights.squeeze(0)
        return (y, weights) if return_weights else y

    def explain_dispatch(
        self, x: torch.Tensor, *, context: torch.Tensor | None = None, key: torch.Tensor | None = None,
        value: torch.Tensor | None = None, mask: torch.Tensor | None = None, causal: bool = False,
        cache: KVCache | None = None, return_weights: bool = False, warn_bytes: int | None = None,
        statistics: tuple[str, ...] = (),
    ) -> DispatchInfo:
        """Which backend and kernel :meth:`forward` would run for these inputs, and why (nothing is computed):
        the same :class:`~headwise.plan.Plan` that ``forward`` executes.

        Args:
            x, context, key, value, mask, causal, cache, return_weights: as given to :meth:`forward`.
            warn_bytes: a MaterializationWarning above this many probability bytes (None: ``dispatch.WARN_BYTES``).
            statistics: per-head statistics a trace would capture (:data:`headwise.plan.STATISTICS`).

        Shapes:
            x: (b, s_q, d) or (s_q, d); context, key: (b, s_kv, kdim); value: (b, s_kv, vdim)
            mask: broadcastable to (b, h, s_q, s_kv)

        Example:
            >>> attn = MultiHeadAttention(d_model=32, n_heads=4)
            >>> info = attn.explain_dispatch(torch.randn(2, 6, 32), causal=True)
            >>> info.backend, info.causal_via, info.materializes_probabilities
            ('sdpa', 'kernel is_causal', False)
            >>> attn.explain_dispatch(torch.randn(2, 6, 32), return_weights=True).probability_bytes
            1152
        """
        return explain_forward(self, x, context=context, key=key, value=value, mask=mask, causal=causal, cache=cache,
                               return_weights=return_weights, warn_bytes=warn_bytes, statistics=statistics)

    # -- copies: a trace's tracer belongs to the layer it was put on, never to a copy ------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("tracer", None)
        state.pop(PLAN_KEY, None)  # it refers to this layer's cache
        state.pop(QUERY_PLAN_KEY, None)
        return state

    # -- checkpoints: the config rides in the state dict's metadata (see headwise.checkpoint) -------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        checkpoint.record(destination, prefix, self.config)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):  # type: ignore[no-untyped-def]
        checkpoint.check(local_metadata, prefix, self.config)  # before any weight is copied
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)

    # -- decoding -----------------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> KVCache:
        """A preallocated :class:`KVCache` for this layer (n_kv_heads heads, the weights' dtype/device),
        bound to it: another layer refuses it.

        Example:
            >>> attn = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=1)
            >>> cache = attn.new_cache(batch_size=2, max_len=10)
            >>> x = torch.randn(2, 6, 32)
            >>> full = attn(x, causal=True)
            >>> steps = [attn(x[:, :4], cache=cache)] + [attn(x[:, t:t + 1], cache=cache) for t in (4, 5)]
            >>> torch.testing.assert_close(torch.cat(steps, dim=1), full)
        """
        w = self.k_proj.weight
        cache = KVCache(batch_size, max_len, self.n_kv_heads, self.d_head, dtype=dtype or w.dtype,
                        device=device or w.device)
        cache.claim(self)
        return cache

    def extra_repr(self) -> str:
        c = self.config
        origin = self.__dict__.get(ORIGINAL_HEADS)  # after head surgery: which original heads these are
        return (f"d_model={c.d_model}, n_heads={c.n_heads}, n_kv_heads={c.n_kv_heads}, d_head={c.d_head}, "
                f"kind={c.kind}, backend={self.backend!r}"
                + ("" if origin is None else f", original heads {list(origin)}"))
