"""One attention head as an object: its own W_Q, W_K, W_V slices, its own softmax, its own context.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width (d_model), d_h: head width (d_head).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from . import functional as hwf
from .config import check_scale
from .validation import check_forward, check_tensor
from .masks import validate_mask
from .stored_weights import packed_weight, recomputed_weight

#: Where head surgery keeps the original index of every head a module has now (in the module's ``__dict__``:
#: the layer's, or the patched Hugging Face module's), so a layer's ``repr`` can name them.
ORIGINAL_HEADS = "headwise_original_heads"

if TYPE_CHECKING:
    from .config import AttentionConfig
    from .rotary import RotaryEmbedding

__all__ = ["AttentionHead", "LayerHeads", "pack_heads"]

_WEIGHTS = ("w_q", "w_k", "w_v")
_BIASES = ("b_q", "b_k", "b_v")


def _float_weight(proj: object, what: str) -> torch.Tensor:
    """``proj.weight``, refused (``TypeError``) where it is no tensor: a head's weights are slices of it."""
    w = proj.weight
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{what} is {packed_weight(proj) or f'a {type(proj).__name__} whose weight is no tensor'}")
    return w


class AttentionHead(nn.Module):
    """A single attention head: ``softmax((x W_Q)(c W_K)^T * scale) (c W_V)``, shape ``(s_q, d_head)``.

    Two kinds exist. ``attn.head(i)`` is a *view*: its weights are slices of the layer's packed
    parameters (no copy), so writing to them changes the layer and gradients flow into the layer; it
    owns no parameters of its own. ``AttentionHead(w_q, w_k, w_v, ...)`` is *standalone* and owns its
    weights as parameters; a layer's ``from_heads`` packs such heads into one layer.

    Under GQA/MQA a view head owns its W_Q slice and *shares* W_K/W_V with the other query heads of its
    group (``kv_index``); changing its ``w_k`` changes every head of the group.

    A head always runs the eager reference math (it exists to be inspected), without dropout. It takes
    the layer's masks: a per-head mask ``(b, h, s_q, s_kv)`` is reduced to this head's slice.

    Shapes:
        w_q: (d, d_h); w_k: (kdim, d_h); w_v: (vdim, d_h); b_*: (d_h,) or None; w_o: (d_h, d) (view heads)
        x: (b, s_q, d) or (s_q, d) -> (b, s_q, d_h) or (s_q, d_h); weights (b, s_q, s_kv)

    Example:
        >>> head = AttentionHead(torch.randn(16, 4), torch.randn(16, 4), torch.randn(16, 4))
        >>> z, w = head(torch.randn(2, 5, 16), return_weights=True)
        >>> z.shape, w.shape
        (torch.Size([2, 5, 4]), torch.Size([2, 5, 5]))
    """

    def __init__(self, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, b_q: torch.Tensor | None = None,
                 b_k: torch.Tensor | None = None, b_v: torch.Tensor | None = None, *, scale: float | None = None,
                 rotary: "RotaryEmbedding | None" = None) -> None:
        super().__init__()
        for name, t in zip(_WEIGHTS, (w_q, w_k, w_v)):
            check_tensor(name, t)
            if t.dim() != 2:
                raise ValueError(f"{name} must be a 2-D tensor (d_in, d_head), got {tuple(t.shape)}")
        tensors = [("w_q", w_q), ("w_k", w_k), ("w_v", w_v)] + [(n, t) for n, t in zip(_BIASES, (b_q, b_k, b_v))
                                                              if t is not None]
        for name, t in tensors[3:]:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if not w_q.dtype.is_floating_point:
            raise TypeError(f"w_q must be floating point, got {w_q.dtype}")
        for name, t in tensors[1:]:
            if t.dtype != w_q.dtype or t.device != w_q.device:
                raise TypeError(f"every weight and bias must share w_q's dtype and device ({w_q.dtype} on "
                                f"{w_q.device}); {name} is {t.dtype} on {t.device}")
        d_head = w_q.shape[1]
        if w_k.shape[1] != d_head or w_v.shape[1] != d_head:
            raise ValueError(f"w_q, w_k, w_v must share d_head; got {tuple(w_q.shape)}, {tuple(w_k.shape)}, "
                             f"{tuple(w_v.shape)}")
        if not (b_q is None) == (b_k is None) == (b_v is None):
            raise ValueError("pass all three biases b_q, b_k, b_v or none")
        for name, b in zip(_BIASES, (b_q, b_k, b_v)):
            if b is not None and tuple(b.shape) != (d_head,):
                raise ValueError(f"{name} must have shape (d_head={d_head},), got {tuple(b.shape)}")
        self._parent: nn.Module | None = None
        self.index = 0
        self._n_kv_heads: int | None = None
        self.kv_index = 0
        for name, t in zip(_WEIGHTS + _BIASES, (w_q, w_k, w_v, b_q, b_k, b_v)):
            self.register_parameter("_" + name, None if t is None else nn.Parameter(t.detach().clone()))
        check_scale(scale)
        self.scale = d_head ** -0.5 if scale is None else float(scale)
        self.rotary = rotary

    @classmethod
    def view(cls, layer: nn.Module, index: int) -> "AttentionHead":
        """Head ``index`` of ``layer`` as a view of its weights (what ``layer.head(index)`` returns).

        ``layer`` is anything with ``config`` (an :class:`~headwise.AttentionConfig`), ``q_proj``/``k_proj``/
        ``v_proj``/``out_proj`` holding ``weight`` (out, in) and ``bias``, ``rotary``, and
        ``head_mask_row(index, n)`` (which row of an ``n``-head mask belongs to head ``index``).
        """
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        # Not a registered submodule: the head is a window onto the layer, not its owner.
        object.__setattr__(self, "_parent", layer)
        self.index = index
        self._n_kv_heads = layer.config.n_kv_heads
        self.kv_index = layer.config.kv_head_of(index)
        self.scale = layer.config.scale
        object.__setattr__(self, "rotary", layer.rotary)
        return self

    # -- weights: own parameters, or views of the layer's ----------------------------------------------
    def _slice(self, which: str) -> slice:
        d_h = self._parent.d_head
        i = self.index if which == "q" else self.kv_index
        return slice(i * d_h, (i + 1) * d_h)

    def _get(self, name: str) -> torch.Tensor | None:
        if self._parent is None:
            return getattr(self, "_" + name)
        which = name[-1]
        proj = getattr(self._parent, f"{which}_proj")
        w = _float_weight(proj, f"{which}_proj")  # checked for biases too: a packed module's bias is a method
        if name.startswith("w_"):
            return w[self._slice(which)].T  # (d_in, d_h), a view of the packed weight
        return None if proj.bias is None else proj.bias[self._slice(which)]  # (d_h,)

    def _set(self, name: str, value: torch.Tensor) -> None:
        target = self.w_o if name == "w_o" else self._get(name)
        check_tensor(name, value)
        if target is None:
            raise ValueError(f"{name} does not exist on this head (the layer has no bias)")
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{name} must have shape {tuple(target.shape)}, got {tuple(value.shape)}")
        if self._parent is not None:
            self._check_stored(name, target)
        with torch.no_grad():
            target.copy_(value)

    def _check_stored(self, name: str, target: torch.Tensor) -> None:
        """Refuses (``TypeError``, before anything is written) a write into ``target``, this head's part of a
        layer's weight, that would not reach the tensors the layer keeps (:func:`recomputed_weight`)."""
        proj = "out_proj" if name == "w_o" else f"{name[-1]}_proj"
        module, what = getattr(self._parent, proj), proj
        if not isinstance(module, nn.Module):  # a view of a host's weight (fused rows, a Conv1D): judge the host's
            sources = dict(self._parent.sources()) if callable(getattr(self._parent, "sources", None)) else {}
            module = sources.get(proj, self._parent)
            where = getattr(self._parent, "source_names", dict)().get(proj, proj)
            what = proj if where == proj else f"{proj} ({where})"
        why = recomputed_weight(module, target)
        if why:
            raise TypeError(f"cannot write {name} of head {self.index}: {what} {why}")

    w_q = property(lambda self: self._get("w_q"), lambda self, v: self._set("w_q", v),
                   doc="W_Q^h, (d_model, d_head): this head's queries are ``x @ w_q``.")
    w_k = property(lambda self: self._get("w_k"), lambda self, v: self._set("w_k", v),
                   doc="W_K^h, (kdim, d_head); shared by the heads of a K/V group.")
    w_v = property(lambda self: self._get("w_v"), lambda self, v: self._set("w_v", v),
                   doc="W_V^h, (vdim, d_head); shared by the heads of a K/V group.")
    b_q = property(lambda self: self._get("b_q"), lambda self, v: self._set("b_q", v))
    b_k = property(lambda self: self._get("b_k"), lambda self, v: self._set("b_k", v))
    b_v = property(lambda self: self._get("b_v"), lambda self, v: self._set("b_v", v))

    @property
    def w_o(self) -> torch.Tensor:
        """This head's rows of W_O, (d_head, d_model): the head adds ``head(x) @ w_o`` to the layer's output.

        Only view heads have one (a standalone head has no layer yet).
        """
        if self._parent is None:
            # Not AttributeError: nn.Module.__getattr__ would replace this message with "has no attribute".
            raise ValueError("a standalone head has no W_O; take heads from a layer with attn.head(i)")
        return _float_weight(self._parent.out_proj, "out_proj")[:, self._slice("q")].T  # (d_h, d)

    @w_o.setter
    def w_o(self, value: torch.Tensor) -> None:
        self._set("w_o", value)

    @property
    def d_model(self) -> int:
        return self.w_q.shape[0]

    @property
    def d_head(self) -> int:
        return self.w_q.shape[1]

    @property
    def is_view(self) -> bool:
        """True for heads taken from a layer (weights are views of its parameters)."""
        return self._parent is not None

    # -- the head's own computation -----------------------------------------------------------------
    def project(self, x: torch.Tensor, context: torch.Tensor | None = None, *, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """This head's Q, K, V (inputs as :meth:`forward` takes them, unchecked here), projections only.

        With a rotary embedding (``self.rotary``) q and k here are *before* rotary: a trace's q and k (after
        rotary) differ from them at every position but 0. ``self.rotary.rotate(q[:, None], k[:, None], positions)``
        rotates them as :meth:`forward` does.

        Shapes: x (b, s_q, d); context (b, s_kv, kdim) or key (b, s_kv, kdim) and value (b, s_kv, vdim)
            -> (b, s_q, d_h), (b, s_kv, d_h), (b, s_kv, d_h)"""
        if key is None:
            key = value = x if context is None else context
        q, k, v = x @ self.w_q, key @ self.w_k, value @ self.w_v
        if self.b_q is not None:
            q, k, v = q + self.b_q, k + self.b_k, v + self.b_v
        return q, k, v

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, mask: torch.Tensor | None = None, causal: bool = False,
                positions: torch.Tensor | None = None,
                return_weights: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """This head's context vectors, computed alone; inputs as the layer's forward takes them (and refuses).

        Shapes:
            x: (b, s_q, d) or (s_q, d); context: (b, s_kv, kdim); key: (b, s_kv, kdim); value: (b, s_kv, vdim)
            mask: broadcastable to (b, h, s_q, s_kv); positions: (s_q,) or (b, s_q)
            -> (b, s_q, d_h) [, weights (b, s_q, s_kv)]
        """
        x, key, value, positions, batched = self._check_inputs(x, context, key, value, causal, positions)
        # One source of keys and values takes project's (x, context) form, the one subclasses override.
        qkv = self.project(x, key) if key is None or context is not None else self.project(x, key=key, value=value)
        q, k, v = (t.unsqueeze(1) for t in qkv)  # (b, 1, s, d_h)
        if self.rotary is not None:
            pos = torch.arange(x.shape[1], device=x.device) if positions is None else positions  # (s_q,) or (b, s_q)
            q, k = self.rotary.rotate(q, k, pos)
        if mask is not None:
            check_tensor("mask", mask)
            # Checked as passed (a refusal names the caller's shape), then narrowed to this head's row.
            per_head = mask.dim() >= 3 and mask.shape[-3] > 1  # (h, s_q, s_kv) or (b, h, s_q, s_kv)
            n = mask.shape[-3] if per_head else 1
            mask = validate_mask(mask, (q.shape[0], n, q.shape[2], k.shape[2]), q.dtype, q.device)
            if per_head:
                mask = mask.narrow(1, self._mask_row(n), 1)  # (b or 1, 1, s_q or 1, s_kv or 1)
        out, weights = hwf.attention(q, k, v, mask=mask, scale=self.scale, causal=causal, backend="eager")
        out, weights = out[:, 0], weights[:, 0]  # (b, s_q, d_h), (b, s_q, s_kv)
        if not batched:
            out, weights = out[0], weights[0]
        return (out, weights) if return_weights else out

    def _check_inputs(self, x: object, context: object, key: object, value: object, causal: object,
                      positions: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object, bool]:
        """The layer's own checks (and messages) of these inputs, for one head: batched x, key and value (None
        for self-attention), the checked positions, and whether x came batched."""
        w_q = self.w_q
        widths = SimpleNamespace(d_model=w_q.shape[0], kdim=self.w_k.shape[0], vdim=self.w_v.shape[0])
        if isinstance(x, torch.Tensor) and isinstance(context, torch.Tensor) and x.dim() == context.dim() == 3 \
                and x.shape[0] != context.shape[0]:  # named as a head's one source of keys and values
            raise ValueError(f"batch mismatch: x has b={x.shape[0]}, context has b={context.shape[0]}")
        x, key, value, _, positions, batched = check_forward(
            widths, w_q.dtype, w_q.device, self.rotary is not None, x, context, key, value, None, causal, None,
            positions, False)
        return x, key, value, positions, batched

    def _mask_row(self, n: int) -> int:
        """This head's row along the head axis of a per-head mask with ``n`` heads (the layer decides)."""
        if self._parent is None:
            raise ValueError(f"a standalone head takes masks without a head axis (size 1 there), got {n} heads")
        return self._parent.head_mask_row(self.index, n)

    def detach_copy(self) -> "AttentionHead":
        """A standalone head with copies of this head's weights (independent of the layer)."""
        return AttentionHead(self.w_q, self.w_k, self.w_v, self.b_q, self.b_k, self.b_v, scale=self.scale,
                             rotary=self.rotary)

    def extra_repr(self) -> str:
        where = f"view of head {self.index} (kv head {self.kv_index})" if self.is_view else "standalone"
        return f"d_model={self.d_model}, d_head={self.d_head}, {where}"


def _rotary_difference(a: "RotaryEmbedding | None", b: "RotaryEmbedding | None") -> str | None:
    """How two heads' rotary embeddings rotate differently (None where they rotate alike: both None, or the
    same kind and numbers), in words for a refusal."""
    if a is b:
        return None
    if a is None or b is None or type(a) is not type(b):
        return f"{type(a).__name__ if a is not None else 'no rotary'} vs {type(b).__name__ if b is not None else 'no rotary'}"
    for field in ("d_head", "rotary_dim", "attention_scaling"):
        if getattr(a, field) != getattr(b, field):
            return f"{field} {getattr(a, field)} vs {getattr(b, field)}"
    fa, fb = a.inv_freq.cpu(), b.inv_freq.cpu()
    if fa.dtype != fb.dtype:
        return f"inv_freq in {fa.dtype} vs {fb.dtype} (rounded frequencies rotate differently)"
    return None if torch.equal(fa, fb) else "inv_freq (another base or scaling)"


def source_layer(heads: Sequence[AttentionHead]) -> nn.Module | None:
    """The layer every one of ``heads`` is a view of, or None (heads of several layers, or built alone)."""
    parents = {id(h._parent): h._parent for h in heads}
    return next(iter(parents.values())) if len(parents) == 1 else None


def pack_heads(heads: Sequence[AttentionHead], *, out_proj: nn.Linear,
               n_kv_heads: int | None = None) -> tuple["AttentionConfig", dict[str, torch.Tensor]]:
    """The config and packed tensors of a layer made of ``heads`` and ``out_proj`` (copies nothing yet).

    Returns ``(config, tensors)`` with tensors named like a layer's state dict (``q_proj.weight``...).
    The heads of one K/V group must have identical W_K/W_V (and biases); otherwise this raises, naming the
    heads that differ.

    Shapes:
        each head: w_q (d, d_h), w_k (kdim, d_h), w_v (vdim, d_h); out_proj: Linear(h * d_h -> d)
        -> q_proj.weight (h * d_h, d), k_proj.weight / v_proj.weight (h_kv * d_h, kdim / vdim)
    """
    from .config import AttentionConfig

    expected = "from_heads needs a non-empty sequence of AttentionHead"
    given = type(heads).__name__
    try:  # a string iterates, but its items are no heads
        items = None if isinstance(heads, (str, bytes, AttentionHead)) else iter(heads)
    except TypeError:
        items = None
    if items is None:
        one = "; pass a list: [head]" if isinstance(heads, AttentionHead) else ""
        raise TypeError(f"{expected}, got {given}{one}")
    heads = list(items)
    if not heads:
        raise TypeError(f"{expected}, got an empty {given}")
    for i, h in enumerate(heads):
        if not isinstance(h, AttentionHead):
            # Matched by name: this core module cannot import the interop package that defines LatentHead.
            latent = (": heads of multi-head latent attention (LatentHead) cannot be packed, their Q, K and V read "
                      "latents shared by every head, not x" if type(h).__name__ == "LatentHead" else "")
            raise TypeError(f"{expected}, got {type(h).__name__} at position {i}{latent}")
    if not isinstance(out_proj, nn.Linear):
        raise TypeError(f"out_proj must be an nn.Linear, got {type(out_proj).__name__}")
    first = heads[0]
    d_model, d_head = first.d_model, first.d_head
    kdim, vdim = first.w_k.shape[0], first.w_v.shape[0]
    has_bias = first.b_q is not None
    for i, h in enumerate(heads):
        shapes = (h.w_q.shape, h.w_k.shape, h.w_v.shape)
        if shapes != (first.w_q.shape, first.w_k.shape, first.w_v.shape):
            raise ValueError(f"head {i} has weight shapes {[tuple(s) for s in shapes]}, head 0 has "
                             f"{[tuple(first.w_q.shape), tuple(first.w_k.shape), tuple(first.w_v.shape)]}")
        if (h.b_q is not None) != has_bias or h.scale != first.scale:
            raise ValueError(f"head {i} differs from head 0 in bias presence or scale")
        if h.w_q.dtype != first.w_q.dtype or h.w_q.device != first.w_q.device:  # a head's tensors share both
            raise TypeError(f"every head must share head 0's dtype and device ({first.w_q.dtype} on "
                            f"{first.w_q.device}); head {i} is {h.w_q.dtype} on {h.w_q.device}")
        differs = _rotary_difference(h.rotary, first.rotary)
        if differs:  # one layer has one rotary embedding for all its heads
            raise ValueError(f"head {i} rotates differently from head 0 ({differs}: {h.rotary!r} vs "
                             f"{first.rotary!r}); a layer's heads share one rotary embedding")
    n = len(heads)
    if n_kv_heads is None:
        recorded = {h._n_kv_heads for h in heads}
        n_kv_heads = recorded.pop() if len(recorded) == 1 and None not in recorded else n
    if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int) or n_kv_heads <= 0 or n % n_kv_heads:
        raise ValueError(f"n_kv_heads must be a positive int dividing the {n} heads given, got {n_kv_heads!r}")
    group = n // n_kv_heads
    for g in range(n_kv_heads):
        ref = heads[g * group]
        for j in range(g * group + 1, (g + 1) * group):
            for name in ("w_k", "w_v", "b_k", "b_v"):
                a, b = getattr(ref, name), getattr(heads[j], name)
                if a is not None and not torch.equal(a, b):
                    raise ValueError(
                        f"heads {g * group} and {j} share K/V head {g} (n_kv_heads={n_kv_heads}) but their "
                        f"{name} differ; pass n_kv_heads={n} to keep separate K/V heads"
                    )
    for name, t in out_proj.named_parameters():  # copied into the layer as they are: neither cast nor moved
        if t.dtype != first.w_q.dtype or t.device != first.w_q.device:
            raise TypeError(f"out_proj must share the heads' dtype and device ({first.w_q.dtype} on "
                            f"{first.w_q.device}); out_proj.{name} is {t.dtype} on {t.device}")
    expected = (d_model, n * d_head)
    if tuple(out_proj.weight.shape) != expected:
        raise ValueError(f"out_proj must map h * d_head = {n * d_head} -> d_model = {d_model} (weight "
                         f"{expected}), got weight {tuple(out_proj.weight.shape)}")
    layer = source_layer(heads)
    cfg = AttentionConfig(d_model=d_model, n_heads=n, n_kv_heads=n_kv_heads, d_head=d_head, bias=has_bias,
                          out_bias=out_proj.bias is not None, kdim=kdim, vdim=vdim, scale=first.scale,
                          dropout=getattr(getattr(layer, "config", None), "dropout", 0.0))
    kv_heads = [heads[g * group] for g in range(n_kv_heads)]
    tensors = {"q_proj.weight": torch.cat([h.w_q.T for h in heads]),
               "k_proj.weight": torch.cat([h.w_k.T for h in kv_heads]),
               "v_proj.weight": torch.cat([h.w_v.T for h in kv_heads]),
               "out_proj.weight": out_proj.weight}
    if has_bias:
        tensors.update({"q_proj.bias": torch.cat([h.b_q for h in heads]),
                        "k_proj.bias": torch.cat([h.b_k for h in kv_heads]),
                        "v_proj.bias": torch.cat([h.b_v for h in kv_heads])})
    if out_proj.bias is not None:
        tensors["out_proj.bias"] = out_proj.bias
    return cfg, {k: t.detach() for k, t in tensors.items()}


class LayerHeads:
    """The heads of a layer as objects: :meth:`head` / :meth:`heads` (views of the layer's weights) and
    :meth:`from_heads` (heads packed back into a layer). A mixin of ``MultiHeadAttention``, which provides
    ``n_heads``, the projections and the constructor; a parallel layer overrides :meth:`head_mask_row`.
    """

    def head(self, index: int) -> AttentionHead:
        """Head ``index`` as an :class:`AttentionHead` whose weights are views of this layer's (no copy):
        writing to them changes the layer, and gradients through the head reach the layer's parameters.

        Under GQA/MQA the head owns its W_Q slice and shares its group's W_K/W_V slices.

        Example:
            >>> from headwise import MultiHeadAttention
            >>> attn = MultiHeadAttention(d_model=16, n_heads=4)
            >>> h = attn.head(1)
            >>> h.w_q.shape, h.w_q.data_ptr() == attn.q_proj.weight[4:8].data_ptr()
            (torch.Size([16, 4]), True)
        """
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"head index must be an int, got {type(index).__name__}")
        if not -self.n_heads <= index < self.n_heads:
            raise IndexError(f"head index must be in [0, {self.n_heads}), got {index}")
        return AttentionHead.view(self, index % self.n_heads)

    def heads(self) -> list[AttentionHead]:
        """Every head, in order (see :meth:`head`)."""
        return [self.head(i) for i in range(self.n_heads)]

    def head_mask_row(self, index: int, n: int) -> int:
        """Which row of an ``n``-head mask belongs to head ``index`` (for :class:`AttentionHead`)."""
        if n != self.n_heads:
            raise ValueError(f"a per-head mask must have h={self.n_heads} heads on its head axis, got {n}")
        return index

    @classmethod
    def packed_parts(cls, heads: Sequence[AttentionHead]) -> dict[str, nn.Module]:
        """Constructor arguments for what ``heads`` compute beyond W_Q/W_K/W_V (a layer with more parts overrides
        this): none here, so heads with per-head QK-norms are refused rather than silently dropped.

        Args:
            heads: the heads :meth:`from_heads` packs."""
        for i, h in enumerate(heads):
            # an identity norm (QKNormAttention(q_norm=None)) computes what a plain head does
            if norms := [n for n in ("q_norm", "k_norm")
                         if getattr(h, n, None) is not None and not isinstance(getattr(h, n), nn.Identity)]:
                raise ValueError(f"head {i} normalises its queries and keys ({', '.join(norms)}), which "
                                 f"{cls.__name__} has no place for; pack such heads with "
                                 "headwise.interop.hf.qk_norm.QKNormAttention.from_heads")
        return {}

    @classmethod
    def from_heads(
        cls, heads: Sequence[AttentionHead], *, out_proj: nn.Linear, n_kv_heads: int | None = None,
        backend: str | None = None,
    ):  # type: ignore[no-untyped-def]
        """Pack independent heads (and a W_O) into one layer, copying their weights.

        ``n_kv_heads`` defaults to what the heads record (heads taken from a layer know their layer's
        grouping), else one K/V head per head. Heads that are all views of one layer also bring its dropout
        and (``backend=None``) its backend; otherwise dropout is 0 and the backend ``"sdpa"``. The heads of one
        K/V group must have identical W_K/W_V (and biases); otherwise this raises, naming the heads that differ.

        Shapes:
            each head: w_q, w_k, w_v (d, d_h); out_proj: Linear(h * d_h -> d)

        Example:
            >>> from headwise import MultiHeadAttention
            >>> attn = MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2)
            >>> again = MultiHeadAttention.from_heads(attn.heads(), out_proj=attn.out_proj)
            >>> all(torch.equal(a, b) for a, b in zip(attn.state_dict().values(), again.state_dict().values()))
            True
        """
        config, tensors = pack_heads(heads, out_proj=out_proj, n_kv_heads=n_kv_heads)
        extras = cls.packed_parts(heads)
        if backend is None:
            backend = getattr(source_layer(heads), "backend", "sdpa")
        w = tensors["q_proj.weight"]
        attn = cls(config=config, rotary=heads[0].rotary, backend=backend, device=w.device, dtype=w.dtype, **extras)
        with torch.no_grad():
            for name, t in tensors.items():  # the projections; extras came built
                attn.get_parameter(name).copy_(t)
        return attn
