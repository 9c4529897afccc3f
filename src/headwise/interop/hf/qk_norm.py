"""Per-head Q/K normalisation ("QK-norm", as in Qwen3 and Gemma 3): a norm over each head's ``d_h`` features,
applied to queries and keys after the head split and before rotary; the same norm weights serve every head.

* :class:`QKNormMixin`: ``project_q`` / ``project_kv`` / ``project_qkv`` apply ``self.q_norm`` / ``self.k_norm``
  to the split heads, and :meth:`~QKNormMixin.head` returns a :class:`QKNormHead`.
* :class:`QKNormHead`: an :class:`~headwise.AttentionHead` whose ``project`` applies the norms to its own Q, K,
  so a head run alone computes what it computes inside the layer.
* :class:`QKNormAttention`: a standalone layer that owns its norms (what :func:`headwise.interop.from_hf`
  returns for a ``Qwen3Attention``).

A norm is any module mapping ``(..., d_h) -> (..., d_h)`` along the last axis (e.g. HF's ``Qwen3RMSNorm``).

Shapes:
    b: batch, s: sequence, h: query heads, h_kv: key/value heads, d: model width, d_h: head width.

Example:
    >>> import torch
    >>> from torch import nn
    >>> attn = QKNormAttention(d_model=16, n_heads=4, n_kv_heads=2, q_norm=nn.LayerNorm(4), k_norm=nn.LayerNorm(4))
    >>> x = torch.randn(2, 5, 16)
    >>> heads = torch.cat([attn.head(i)(x, causal=True) for i in range(4)], dim=-1)
    >>> torch.testing.assert_close(attn.out_proj(heads), attn(x, causal=True))
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from torch import nn

from ...attention import MultiHeadAttention
from ...head import AttentionHead

__all__ = ["QKNormMixin", "QKNormHead", "QKNormAttention"]


class QKNormMixin:
    """Forward steps with per-head Q/K norms; the class using it provides ``q_norm`` and ``k_norm``."""

    q_norm: nn.Module
    k_norm: nn.Module

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised queries of every head. Shapes: x (b, s_q, d) -> (b, h, s_q, d_h)."""
        return self.q_norm(super().project_q(x))  # (b, h, s_q, d_h): the norm runs over d_h only

    def project_kv(self, key: torch.Tensor, value: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised keys and plain values. Shapes: key (b, s_kv, kdim) -> (b, h_kv, s_kv, d_h) each."""
        k, v = super().project_kv(key, value)
        return self.k_norm(k), v

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K (normalised) and V from one input. Shapes: x (b, s, d) -> (b, h, s, d_h), (b, h_kv, s, d_h) x2."""
        k, v = self.project_kv(x)
        return self.project_q(x), k, v

    def head(self, index: int) -> "QKNormHead":
        """Head ``index`` as a view (see :meth:`MultiHeadAttention.head`) that applies this layer's norms."""
        head = super().head(index)
        head.__class__ = QKNormHead  # same state, one more step in project()
        object.__setattr__(head, "q_norm", self.q_norm)  # references: the head is a window, not an owner
        object.__setattr__(head, "k_norm", self.k_norm)
        return head

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, qk_norm=({self.q_norm}, {self.k_norm})"


class QKNormHead(AttentionHead):
    """One head whose queries and keys go through the layer's per-head norms (before rotary).

    Shapes:
        x: (b, s_q, d) -> q (b, s_q, d_h) normalised over d_h; as :class:`AttentionHead` otherwise
    """

    q_norm: nn.Module
    k_norm: nn.Module

    def project(self, x: torch.Tensor, context: torch.Tensor | None = None, *, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """This head's Q, K (normalised) and V, from the inputs :meth:`AttentionHead.project` takes.
        Shapes: x (b, s_q, d) -> (b, s_q, d_h), (b, s_kv, d_h) x2."""
        q, k, v = super().project(x, context, key=key, value=value)
        return self.q_norm(q), self.k_norm(k), v

    def detach_copy(self) -> "QKNormHead":
        """A standalone head with copies of this head's weights and norms."""
        head = super().detach_copy()
        head.__class__ = QKNormHead
        head.q_norm, head.k_norm = copy.deepcopy(self.q_norm), copy.deepcopy(self.k_norm)
        return head

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, qk_norm"


class QKNormAttention(QKNormMixin, MultiHeadAttention):
    """A :class:`MultiHeadAttention` with per-head Q/K norms that it owns (registered submodules).

    Args:
        q_norm, k_norm: modules normalising the last axis (d_h) of the split queries / keys (None: identity).
        everything else: as :class:`MultiHeadAttention`.

    Shapes:
        as :class:`MultiHeadAttention`
    """

    def __init__(self, *args: Any, q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.q_norm = nn.Identity() if q_norm is None else q_norm
        self.k_norm = nn.Identity() if k_norm is None else k_norm

    @classmethod
    def packed_parts(cls, heads: Sequence[AttentionHead]) -> dict[str, nn.Module]:
        """Copies of the norms every one of ``heads`` applies (None: identity), for :meth:`from_heads`; heads whose
        norms differ are refused, naming them, since a layer's heads share one pair of norms.

        Args:
            heads: the heads :meth:`from_heads` packs.
        """
        parts = {}
        for name in ("q_norm", "k_norm"):
            first = getattr(heads[0], name, None)
            for i, h in enumerate(heads[1:], 1):
                norm = getattr(h, name, None)
                if not _same_norm(first, norm):
                    raise ValueError(f"head {i} has {name}={norm!r}{_difference(first, norm)} but head 0 has "
                                     f"{name}={first!r}; a layer's heads share one pair of norms")
            parts[name] = None if first is None else copy.deepcopy(first)
        return parts


def _same_norm(a: nn.Module | None, b: nn.Module | None) -> bool:
    """Whether two norms compute alike: the same module, or the same kind, settings and weights."""
    if a is b:
        return True
    if a is None or b is None or type(a) is not type(b) or repr(a) != repr(b):
        return False
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]) for k in sa)


def _difference(a: nn.Module | None, b: nn.Module | None) -> str:
    """What tells two norms of the same kind and settings apart, for a message where their reprs read alike."""
    if a is None or b is None or type(a) is not type(b) or repr(a) != repr(b):
        return ""
    sa, sb = a.state_dict(), b.state_dict()
    for key in sa:
        if key not in sb or sa[key].shape != sb[key].shape:
            return f" (its {key} has another shape)"
        if not torch.equal(sa[key], sb[key]):
            gap = (sa[key].double() - sb[key].double()).abs().nan_to_num(float("inf")).max().item()
            return f" (its {key} differs by up to {gap:.3g})"
    return ""
