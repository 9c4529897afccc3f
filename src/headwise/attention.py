"""The multi-head attention layer: packed projections over independent heads.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width (d_model), d_h: head width (d_head).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from . import functional as hwf
from . import _checkpoint
from . import packed_gemm
from ._checks import check_causal, check_input, check_positions
from .chunking import chunk_length, forward_in_chunks
from .config import AttentionConfig
from .dispatch import DispatchInfo, explain, warn_if_eager_too_large
from .head import AttentionHead
from .kv_cache import KVCache
from .masks import validate_mask
from .rotary import RotaryEmbedding

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Multi-head attention (MHA, GQA or MQA) whose heads can be taken out, run alone and put back.

    The per-head matrices W_Q^h, W_K^h, W_V^h (each ``(d_model, d_head)``) are packed into one
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
        bias: biases on all four projections.
        dropout: dropout on attention probabilities, in training mode only.
        rotary: an optional :class:`RotaryEmbedding` applied to Q and K of every head.
        backend: ``"sdpa"`` (default) or ``"eager"``.
        For ``kdim``/``vdim``, a bias-free ``out_proj`` or a custom ``scale``, use :meth:`from_config`.

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

    #: Without autograd, run long forwards in query chunks (see :mod:`headwise.chunking`); set False to opt out.
    chunk_queries: bool = True

    def __init__(
        self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *, d_head: int | None = None,
        bias: bool = True, dropout: float = 0.0, rotary: RotaryEmbedding | None = None, backend: str = "sdpa",
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        config = AttentionConfig(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head,
                                 bias=bias, dropout=dropout)
        self._setup(config, rotary=rotary, backend=backend, device=device, dtype=dtype)

    @classmethod
    def from_config(
        cls, config: AttentionConfig, *, rotary: RotaryEmbedding | None = None, backend: str = "sdpa",
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> "MultiHeadAttention":
        """Build a layer from an :class:`AttentionConfig` (all its fields, kdim/vdim/out_bias/scale too).

        Example:
            >>> cfg = AttentionConfig(d_model=32, n_heads=4, kdim=16, vdim=24, out_bias=False)
            >>> attn = MultiHeadAttention.from_config(cfg)
            >>> attn(torch.randn(2, 3, 32), key=torch.randn(2, 7, 16), value=torch.randn(2, 7, 24)).shape
            torch.Size([2, 3, 32])
        """
        if not isinstance(config, AttentionConfig):
            raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(config, rotary=rotary, backend=backend, device=device, dtype=dtype)
        return self

    def _setup(self, config: AttentionConfig, *, rotary: RotaryEmbedding | None, backend: str,
               device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        if backend not in hwf.available_backends():
            raise ValueError(f"backend must be one of {hwf.available_backends()}, got {backend!r}")
        if rotary is not None:
            if not isinstance(rotary, RotaryEmbedding):
                raise TypeError(f"rotary must be a RotaryEmbedding, got {type(rotary).__name__}")
            if rotary.d_head != config.d_head:
                raise ValueError(f"rotary was built for d_head={rotary.d_head}, the layer has d_head={config.d_head}")
        self.config = config
        self.backend = backend
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(config.d_model, config.inner_dim, bias=config.bias, **kw)
        self.k_proj = nn.Linear(config.kdim, config.kv_dim, bias=config.bias, **kw)
        self.v_proj = nn.Linear(config.vdim, config.kv_dim, bias=config.bias, **kw)
        self.out_proj = nn.Linear(config.inner_dim, config.d_model, bias=config.out_bias, **kw)
        self.rotary = rotary
        self._gemm_rows: int | None = None  # see use_packed_gemm
        self._packed: dict[str, packed_gemm.PackedWeight] = {}

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def d_model(self) -> int:
        return self.config.d_model

    @property
    def n_heads(self) -> int:
        return self.config.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.config.n_kv_heads

    @property
    def d_head(self) -> int:
        return self.config.d_head

    # -- packed GEMM (opt-in, CPU float32 inference) ------------------------------------------------------
    def use_packed_gemm(self, rows: int | None = 1) -> "MultiHeadAttention":
        """Run the four projections on MKL's packed GEMM for calls of ``rows`` rows (``b * s_q``; 1 decodes one
        sequence a token at a time); ``None`` turns it off and frees the packed copies. Returns the layer.

        The weights are blocked once, here, into the layout MKL's GEMM consumes; calls with another row count,
        calls that need gradients and compiled calls run the ordinary path. A packed copy is rebuilt after any
        in-place change of its weight; it costs memory next to the weight (see :mod:`headwise.packed_gemm`).

        Raises:
            ValueError: ``rows`` is not a positive int or None, or the weights are inference tensors (made
                under ``torch.inference_mode``: no version counter, so a later write could not be detected).
            TypeError: the weights are not float32 on the CPU.
            RuntimeError: this PyTorch build has no MKL packed GEMM (:func:`headwise.packed_gemm.available`).

        Shapes:
            calls served: x (b, s_q, d) with b * s_q == rows

        Example:
            >>> attn = MultiHeadAttention(d_model=32, n_heads=4).eval()
            >>> cache = attn.new_cache(batch_size=1, max_len=4)
            >>> x = torch.randn(1, 4, 32)
            >>> with torch.no_grad():
            ...     plain = attn(x, causal=True)
            ...     if packed_gemm.available():
            ...         _ = attn.use_packed_gemm(rows=1)
            ...     steps = torch.cat([attn(x[:, t:t + 1], cache=cache) for t in range(4)], dim=1)
            >>> torch.testing.assert_close(steps, plain)
        """
        rows = packed_gemm.check_rows(rows)
        self._packed = {}
        if rows is None:
            self._gemm_rows = None
            return self
        if not packed_gemm.available():
            raise RuntimeError("this PyTorch build has no MKL packed GEMM (torch.backends.mkl.is_available() is "
                               f"{torch.backends.mkl.is_available()}); use_packed_gemm needs an x86 build with MKL")
        names = ("q_proj", "k_proj", "v_proj", "out_proj")
        for name in names:
            packed_gemm.check_weight(name, getattr(self, name).weight)
        self._packed = {name: packed_gemm.PackedWeight(getattr(self, name).weight, rows) for name in names}
        self._gemm_rows = rows
        return self

    @property
    def packed_gemm_rows(self) -> int | None:
        """The row count the projections run MKL's packed GEMM for (None: off; see :meth:`use_packed_gemm`)."""
        return self._gemm_rows

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self._gemm_rows is None:
            return getattr(self, name)(x)
        return packed_gemm.linear(getattr(self, name), x, self._gemm_rows, self._packed, name)

    def _apply(self, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        # .to()/.float()/.cuda() replace the weights: drop the packed copies (they would keep the old storage
        # alive); they are rebuilt on the next call that can use them.
        self._packed = {}
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):  # type: ignore[no-untyped-def]
        # Packed copies are opaque MKL buffers tied to this process's weights: pickles and deep copies drop them
        # (keeping the row count, so the copy packs its own weights on first use).
        state = dict(super().__getstate__())
        state["_packed"] = {}
        return state

    def __setstate__(self, state):  # type: ignore[no-untyped-def]
        super().__setstate__(state)
        self.__dict__.setdefault("_gemm_rows", None)  # pickled before use_packed_gemm existed
        self.__dict__.setdefault("_packed", {})

    # -- the forward, in composable steps -----------------------------------------------------------
    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """Queries of every head. Shapes: x (b, s_q, d) -> (b, h, s_q, d_h)."""
        return hwf.split_heads(self._linear("q_proj", x), self.config.n_heads)  # (b, h, s_q, d_h)

    def project_kv(self, key: torch.Tensor, value: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every K/V head. Shapes: key (b, s_kv, kdim), value (b, s_kv, vdim)
        -> (b, h_kv, s_kv, d_h) each."""
        value = key if value is None else value
        k = hwf.split_heads(self._linear("k_proj", key), self.config.n_kv_heads)  # (b, h_kv, s_kv, d_h)
        v = hwf.split_heads(self._linear("v_proj", value), self.config.n_kv_heads)  # (b, h_kv, s_kv, d_h)
        return k, v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
        causal: bool = False, return_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-head attention on already split heads (the layer's dropout, scale and backend).

        Shapes:
            q: (b, h, s_q, d_h); k, v: (b, h_kv, s_kv, d_h) -> (b, h, s_q, d_h), weights or None
        """
        backend = "eager" if return_weights else self.backend  # hwf.attention validates q, k, v and mask
        if backend == "eager":
            warn_if_eager_too_large(q, k)
        dropout_p = self.config.dropout if self.training else 0.0
        return hwf.attention(q, k, v, mask=mask, scale=self.config.scale, dropout_p=dropout_p, causal=causal,
                            backend=backend)

    def project_out(self, context: torch.Tensor) -> torch.Tensor:
        """Merge heads and apply W_O, the only place heads mix. Shapes: (b, h, s_q, d_h) -> (b, s_q, d)."""
        return self._linear("out_proj", hwf.merge_heads(context))  # (b, s_q, d)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor | None = None, *, key: torch.Tensor | None = None,
        value: torch.Tensor | None = None, mask: torch.Tensor | None = None, causal: bool = False,
        cache: KVCache | None = None, positions: torch.Tensor | None = None, return_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``x`` to itself, to ``context``, or to separate ``key``/``value`` inputs.

        With ``cache``, the new keys/values are appended and ``x`` attends causally (bottom-right) over
        everything cached, so prefill-then-decode equals one causal pass. ``positions`` (rotary only)
        default to ``cache.length + arange(s_q)``.

        Shapes:
            x: (b, s_q, d) or (s_q, d); context: (b, s_kv, d); key: (b, s_kv, kdim); value: (b, s_kv, vdim)
            mask: broadcastable to (b, h, s_q, s_kv); positions: (s_q,) or (b, s_q)
            -> (b, s_q, d) [, weights (b, h, s_q, s_kv)]
        """
        check_causal(causal)
        x, key, value, batched = self._check_inputs(x, context, key, value, cache)
        cross = key is not None
        chunk = self._query_chunk(x, key, value, cache, return_weights)
        if chunk is not None:
            y = self._forward_in_chunks(x, key, value, mask=mask, causal=causal, positions=positions, chunk=chunk)
            return y if batched else y.squeeze(0)
        q = self.project_q(x)
        k, v = self.project_kv(key, value) if cross else self.project_kv(x)
        offset = 0
        if cache is not None:
            offset = cache.length
            causal = True
        if self.rotary is not None:
            if positions is None:
                positions = torch.arange(offset, offset + x.shape[1], device=x.device)
            else:
                positions = check_positions(positions, x.shape[0], x.shape[1])
            q, k = self.rotary.rotate(q, k, positions)
        if cache is not None:
            if mask is not None:  # checked before the write, so a failed call leaves the cache untouched
                mask = validate_mask(mask, (q.shape[0], q.shape[1], q.shape[2], offset + k.shape[2]), q.dtype,
                                     q.device)
            k, v = cache.update(k, v)
        out, weights = self.attend(q, k, v, mask=mask, causal=causal, return_weights=return_weights)
        # Free Q/K/V (3 x s x d floats without autograd) before W_O allocates the output: the forward's peak
        # is then Q/K/V + context, not Q/K/V + context + output.
        del q, k, v
        y = self.project_out(out)
        if not batched:
            y = y.squeeze(0)
            weights = weights.squeeze(0) if weights is not None else None
        return (y, weights) if return_weights else y

    def _query_chunk(self, x, key, value, cache, return_weights):  # type: ignore[no-untyped-def]
        """Positions per query chunk when this forward may run chunked (see :mod:`headwise.chunking`), else None."""
        if (not self.chunk_queries or cache is not None or return_weights or self.backend != "sdpa"
                or (self.training and self.config.dropout)):
            return None
        s_kv = x.shape[1] if key is None else key.shape[1]
        chunk = chunk_length(self, x.shape[0], x.shape[1], s_kv, x.dtype)
        if chunk is None or not torch.is_grad_enabled():
            return chunk
        # With autograd on, chunking saves nothing (the graph keeps every chunk's activations).
        tracked = any(t is not None and t.requires_grad for t in (x, key, value))
        return None if tracked or any(p.requires_grad for p in self.parameters()) else chunk

    def _forward_in_chunks(self, x, key, value, *, mask, causal, positions, chunk):  # type: ignore[no-untyped-def]
        s_kv = x.shape[1] if key is None else key.shape[1]
        if mask is not None:
            mask = validate_mask(mask, (x.shape[0], self.n_heads, x.shape[1], s_kv), x.dtype, x.device)
        if positions is not None and self.rotary is not None:
            positions = check_positions(positions, x.shape[0], x.shape[1])
        with torch.no_grad():
            return forward_in_chunks(self, x, key, value, mask=mask, causal=causal, positions=positions,
                                     chunk=chunk)

    def _check_inputs(self, x, context, key, value, cache):  # type: ignore[no-untyped-def]
        """Validate the forward's inputs; return them batched, with ``key``/``value`` None for self-attention."""
        cfg = self.config
        w = self.q_proj.weight
        x = check_input("x", x, cfg.d_model, "d_model", w.dtype, w.device)
        batched = x.dim() == 3
        if (key is None) != (value is None):
            raise ValueError("pass both key= and value= (or neither)")
        if key is not None and context is not None:
            raise ValueError("pass either context= or key=/value=, not both")
        if key is not None:
            key = check_input("key", key, cfg.kdim, "kdim", w.dtype, w.device, batched=batched)
            value = check_input("value", value, cfg.vdim, "vdim", w.dtype, w.device, batched=batched)
        elif context is not None:
            if cfg.kdim != cfg.vdim:
                raise ValueError(f"kdim={cfg.kdim} != vdim={cfg.vdim}: pass key= and value= separately")
            key = value = check_input("context", context, cfg.kdim, "kdim", w.dtype, w.device, batched=batched)
        if not batched:
            x = x.unsqueeze(0)
            key = None if key is None else key.unsqueeze(0)
            value = None if value is None else value.unsqueeze(0)
        if key is not None:
            if key.shape[0] != x.shape[0] or value.shape[0] != x.shape[0]:
                raise ValueError(f"batch mismatch: x has b={x.shape[0]}, key/context has b={key.shape[0]}, "
                                 f"value has b={value.shape[0]}")
            if key.shape[1] != value.shape[1]:
                raise ValueError(f"key has s_kv={key.shape[1]} but value has s_kv={value.shape[1]}")
            if cache is not None:
                raise ValueError("cache= is for self-attention decoding; cross-attention keys need no cache")
            if self.rotary is not None:
                raise ValueError("rotary embeddings apply to self-attention only; got context/key inputs")
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache (see new_cache), got {type(cache).__name__}")
        return x, key, value, batched

    # -- heads as objects ---------------------------------------------------------------------------
    def head(self, index: int) -> AttentionHead:
        """Head ``index`` as an :class:`AttentionHead` whose weights are views of this layer's (no copy):
        writing to them changes the layer, and gradients through the head reach the layer's parameters.

        Under GQA/MQA the head owns its W_Q slice and shares its group's W_K/W_V slices.

        Example:
            >>> attn = MultiHeadAttention(d_model=16, n_heads=4)
            >>> h = attn.head(1)
            >>> h.w_q.shape, h.w_q.data_ptr() == attn.q_proj.weight[4:8].data_ptr()
            (torch.Size([16, 4]), True)
        """
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"head index must be an int, got {type(index).__name__}")
        if not -self.n_heads <= index < self.n_heads:
            raise IndexError(f"head index must be in [0, {self.n_heads}), got {index}")
        return AttentionHead._view_of(self, index % self.n_heads)

    def heads(self) -> list[AttentionHead]:
        """Every head, in order (see :meth:`head`)."""
        return [self.head(i) for i in range(self.n_heads)]

    @classmethod
    def from_heads(
        cls, heads: Sequence[AttentionHead], *, out_proj: nn.Linear, n_kv_heads: int | None = None,
        backend: str = "sdpa",
    ) -> "MultiHeadAttention":
        """Pack independent heads (and a W_O) into one layer, copying their weights.

        ``n_kv_heads`` defaults to what the heads record (heads taken from a layer know their layer's
        grouping), else one K/V head per head. The heads of one K/V group must have identical
        W_K/W_V (and biases); otherwise this raises, naming the heads that differ.

        Shapes:
            each head: w_q, w_k, w_v (d, d_h); out_proj: Linear(h * d_h -> d)

        Example:
            >>> attn = MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2)
            >>> again = MultiHeadAttention.from_heads(attn.heads(), out_proj=attn.out_proj)
            >>> all(torch.equal(a, b) for a, b in zip(attn.state_dict().values(), again.state_dict().values()))
            True
        """
        from .head import _pack_heads

        return _pack_heads(cls, heads, out_proj=out_proj, n_kv_heads=n_kv_heads, backend=backend)

    # -- checkpoints: the config rides in the state dict's metadata (see headwise._checkpoint) ---------
    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        _checkpoint.record(destination, prefix, self.config)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):  # type: ignore[no-untyped-def]
        _checkpoint.check(local_metadata, prefix, self.config)  # before any weight is copied
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)

    # -- dispatch ---------------------------------------------------------------------------------------
    def explain_dispatch(
        self, x: torch.Tensor, *, context: torch.Tensor | None = None, mask: torch.Tensor | None = None,
        causal: bool = False, cache: KVCache | None = None, return_weights: bool = False,
        warn_bytes: int | None = None,
    ) -> DispatchInfo:
        """Which backend and kernel :meth:`forward` would run for these inputs, and why (nothing is computed).

        Warns (:class:`headwise.MaterializationWarning`) if the path would materialise more than
        ``warn_bytes`` (default :data:`headwise.dispatch.WARN_BYTES`) of probabilities. See
        :mod:`headwise.dispatch` for the rules.

        Shapes:
            x: (b, s_q, d) or (s_q, d); context: (b, s_kv, kdim); mask: broadcastable to (b, h, s_q, s_kv)

        Example:
            >>> attn = MultiHeadAttention(d_model=32, n_heads=4)
            >>> info = attn.explain_dispatch(torch.randn(2, 6, 32), causal=True)
            >>> info.backend, info.causal_via, info.materializes_probabilities
            ('sdpa', 'kernel is_causal', False)
            >>> attn.explain_dispatch(torch.randn(2, 6, 32), return_weights=True).probability_bytes
            1152
        """
        return explain(self, x, context=context, mask=mask, causal=causal, cache=cache,
                       return_weights=return_weights, warn_bytes=warn_bytes)

    # -- decoding -------------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> KVCache:
        """A preallocated :class:`KVCache` for this layer (n_kv_heads heads, the weights' dtype/device).

        Example:
            >>> attn = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=1)
            >>> cache = attn.new_cache(batch_size=2, max_len=10)
            >>> x = torch.randn(2, 6, 32)
            >>> full = attn(x, causal=True)
            >>> steps = [attn(x[:, :4], cache=cache)] + [attn(x[:, t:t + 1], cache=cache) for t in (4, 5)]
            >>> torch.testing.assert_close(torch.cat(steps, dim=1), full)
        """
        w = self.k_proj.weight
        return KVCache(batch_size, max_len, self.n_kv_heads, self.d_head, dtype=dtype or w.dtype,
                       device=device or w.device)

    def extra_repr(self) -> str:
        c = self.config
        return (f"d_model={c.d_model}, n_heads={c.n_heads}, n_kv_heads={c.n_kv_heads}, d_head={c.d_head}, "
                f"kind={c.kind}, backend={self.backend!r}")
