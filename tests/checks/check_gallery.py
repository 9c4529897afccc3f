"""A gallery of attention layers for headwise.check: one correct reference and one layer per classic bug.

Every layer is written from the formula here (no headwise code) and follows headwise's calling convention
(``forward(x, *, mask=None, causal=False, return_weights=False)``, bool mask True = may attend), with
``q_proj``/``k_proj``/``v_proj``/``out_proj`` and ``n_heads``/``n_kv_heads`` so that heads are exposed.
Each bug overrides exactly one step of :class:`RefAttention`. The module-level factories are used by the
CLI tests (``headwise check tests.checks.check_gallery:flatten_bug``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn


class RefAttention(nn.Module):
    """Correct multi-head attention (MHA or GQA), one overridable method per step."""

    def __init__(self, d_model: int = 32, n_heads: int = 4, n_kv_heads: int | None = None) -> None:
        super().__init__()
        self.d_model, self.n_heads = d_model, n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.d_head = d_model // n_heads
        self.q_proj = nn.Linear(d_model, n_heads * self.d_head)
        self.k_proj = nn.Linear(d_model, self.n_kv_heads * self.d_head)
        self.v_proj = nn.Linear(d_model, self.n_kv_heads * self.d_head)
        self.out_proj = nn.Linear(n_heads * self.d_head, d_model)

    def split(self, t: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, n, self.d_head).transpose(1, 2)  # (b, n, s, d_h)

    def kv_head_of(self) -> torch.Tensor:
        return torch.arange(self.n_heads) // (self.n_heads // self.n_kv_heads)

    def scale(self) -> float:
        return 1 / math.sqrt(self.d_head)

    def causal_blocked(self, s: int, device) -> torch.Tensor:
        return torch.ones(s, s, dtype=torch.bool, device=device).triu(1)  # True = future key

    def apply_padding(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(~mask, float("-inf"))

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.softmax(dim=-1)

    def mix_heads(self, ctx: torch.Tensor) -> torch.Tensor:
        return ctx

    def merge(self, ctx: torch.Tensor) -> torch.Tensor:
        b, h, s, d_h = ctx.shape
        return ctx.transpose(1, 2).reshape(b, s, h * d_h)  # (b, s, h * d_h)

    def value_input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values, (b, h, s, d_h) each: K/V heads already repeated for their query heads.

        Args:
            x: the layer's input, (b, s, d_model)."""
        q = self.split(self.q_proj(x), self.n_heads)
        k = self.split(self.k_proj(x), self.n_kv_heads)[:, self.kv_head_of()]
        v = self.split(self.v_proj(self.value_input(x)), self.n_kv_heads)[:, self.kv_head_of()]
        return q, k, v

    def masked_scores(self, q: torch.Tensor, k: torch.Tensor, *, mask=None, causal=False) -> torch.Tensor:
        """Scaled q . k with blocked keys at -inf, (b, h, s, s).

        Args:
            q, k: (b, h, s, d_h) queries and keys (K/V heads repeated).
            mask: optional bool (b, 1, 1, s), True = may attend.
            causal: whether future keys are blocked."""
        scores = q @ k.transpose(-2, -1) * self.scale()
        if causal:
            scores = scores.masked_fill(self.causal_blocked(q.shape[2], q.device), float("-inf"))
        if mask is not None:
            scores = self.apply_padding(scores, mask)
        return scores

    def attend(self, q, k, v, *, mask=None, causal=False, return_weights=False):
        """Every step after the projections, so that layers which build q, k or v their own way (QK-norms, keys
        from elsewhere) share the rest of the formula.

        Args:
            q, k, v: (b, h, s, d_h) each, K/V heads repeated.
            mask, causal, return_weights: as in :meth:`forward`."""
        w = self.softmax(self.masked_scores(q, k, mask=mask, causal=causal))
        y = self.out_proj(self.merge(self.mix_heads(w @ v)))
        return (y, w) if return_weights else y

    def forward(self, x, *, mask=None, causal=False, return_weights=False):
        return self.attend(*self.project(x), mask=mask, causal=causal, return_weights=return_weights)


class QKNormRef(RefAttention):
    """Correct attention with per-head norms on q and k before the scores (Qwen3, Gemma 3): a step of the user's own
    that the check cannot rebuild q . k through.

    Args:
        norm: builds one norm from the head width d_head."""

    def __init__(self, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.q_norm, self.k_norm = norm(self.d_head), norm(self.d_head)

    def project(self, x):
        q = self.q_norm(self.split(self.q_proj(x), self.n_heads))
        k = self.k_norm(self.split(self.k_proj(x), self.n_kv_heads))[:, self.kv_head_of()]
        v = self.split(self.v_proj(x), self.n_kv_heads)[:, self.kv_head_of()]
        return q, k, v


class FlattenNoTranspose(RefAttention):
    """(b, h, s, d_h) flattened to (b, s, h * d_h) without moving heads back behind tokens."""

    def merge(self, ctx):
        b, h, s, d_h = ctx.shape
        return ctx.reshape(b, s, h * d_h)


class SoftmaxWrongAxis(RefAttention):
    """Softmax over queries instead of keys."""

    def softmax(self, scores):
        return scores.softmax(dim=-2)


class ScaleOverDHead(RefAttention):
    def scale(self):
        return 1 / self.d_head


class ScaleOverSqrtDModel(RefAttention):
    def scale(self):
        return 1 / math.sqrt(self.d_model)


class NoScale(RefAttention):
    def scale(self):
        return 1.0


class CausalOffByOne(RefAttention):
    """triu(2) instead of triu(1): every token also reads the next one."""

    def causal_blocked(self, s, device):
        return torch.ones(s, s, dtype=torch.bool, device=device).triu(2)


class PaddingIgnored(RefAttention):
    """Takes a mask and never applies it."""

    def apply_padding(self, scores, mask):
        return scores


class GQAWrongSharing(RefAttention):
    """Query head h reads K/V head h % n_kv_heads instead of h // (n_heads / n_kv_heads)."""

    def __init__(self, d_model: int = 32, n_heads: int = 4, n_kv_heads: int | None = 2) -> None:
        super().__init__(d_model, n_heads, n_kv_heads)

    def kv_head_of(self):
        return torch.arange(self.n_heads) % self.n_kv_heads


class HeadsMixedBeforeWO(RefAttention):
    """Each head's context gets half of its neighbour's before W_O."""

    def mix_heads(self, ctx):
        return ctx + 0.5 * ctx.roll(1, dims=1)


# name -> (layer class, causal claim, the exact set of properties it must fail, and why)
GALLERY = {
    # token rows are built from other tokens' (and padded tokens') contexts, and head slots are scrambled: W_O's
    # input is no head's weights times its values
    "flatten_without_transpose": (FlattenNoTranspose, False, {"permutation_equivariance", "padding_invariance",
                                                              "softmax_sanity", "head_independence"}),
    # rows do not sum to 1; a fully padded key column is all -inf over queries, so padded samples give NaN
    "softmax_wrong_axis": (SoftmaxWrongAxis, False, {"softmax_sanity", "padding_invariance"}),
    "scale_1_over_d_head": (ScaleOverDHead, False, {"softmax_sanity"}),
    "scale_1_over_sqrt_d_model": (ScaleOverSqrtDModel, False, {"softmax_sanity"}),
    "no_scale": (NoScale, False, {"softmax_sanity"}),
    # reads the next token, and its weights put mass on a masked (future) key
    "causal_mask_off_by_one": (CausalOffByOne, True, {"causality", "softmax_sanity"}),
    # padded keys change real outputs, and get non-zero weight
    "padding_mask_ignored": (PaddingIgnored, False, {"padding_invariance", "softmax_sanity"}),
    "gqa_kv_heads_shared_wrongly": (GQAWrongSharing, False, {"head_independence"}),
    # each head's context is no longer its weights times its values, and W_Q of one head moves two contexts
    "heads_mixed_before_w_o": (HeadsMixedBeforeWO, False, {"softmax_sanity", "head_independence"}),
}


# -- factories for the CLI tests ------------------------------------------------------------------------
def reference() -> RefAttention:
    torch.manual_seed(0)
    return RefAttention()


def flatten_bug() -> FlattenNoTranspose:
    torch.manual_seed(0)
    return FlattenNoTranspose()


def plain_callable(x: torch.Tensor) -> torch.Tensor:
    """A layer that is a plain function f(x) -> y (softmax attention with identity projections)."""
    w = (x @ x.transpose(-2, -1) / math.sqrt(x.shape[-1])).softmax(-1)
    return w @ x


def failing_factory() -> nn.Module:
    raise RuntimeError("this factory is broken on purpose")


LAYER = RefAttention()
NOT_A_LAYER = 42


class ExitsAfterFirstCall(RefAttention):
    """Correct on its first call, then calls sys.exit(0): a layer must not end the check with success."""

    calls = 0

    def forward(self, x: torch.Tensor, **kw):  # type: ignore[override]
        type(self).calls += 1
        if type(self).calls > 1:
            raise SystemExit(0)
        return super().forward(x, **kw)


class ExitsAlways(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise SystemExit(0)


def exits_after_first_call() -> ExitsAfterFirstCall:
    torch.manual_seed(0)
    ExitsAfterFirstCall.calls = 0
    return ExitsAfterFirstCall()
