"""The adapter of an ``nn.Module`` with headwise's calling convention, whose heads are read off its projections.

:class:`ModuleAdapter` runs the module as :class:`~headwise.checks.adapters.CallableAdapter` does and exposes its
heads when it has ``q_proj``/``k_proj``/``v_proj``/``out_proj`` ``nn.Linear`` submodules and an ``n_heads``
attribute (``n_kv_heads`` optional: else read off ``k_proj``'s width), head ``i`` owning output rows
``i * d_head .. (i + 1) * d_head - 1``; q, k and v are rebuilt from the projections, and the module's other
submodules and parameters (:func:`extra_steps`) are named where they may act on them (``qk_steps``, ``v_steps``).
headwise's :class:`~headwise.MultiHeadAttention` uses it, with its KV cache, rotary positions and its own
projection steps (``project_q`` / ``project_kv``: QK-norms included).

Shapes:
    b: batch, s: tokens, d: d_model, h: query heads, h_kv: key/value heads, d_h: head width.
    run: x (b, s, d), keep (b, s) bool -> (b, s, d); q, k (b, h or h_kv, s, d_h); contexts (b, h, s, d_h).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from .adapters import CallableAdapter, NotExposed, capture_input, check_rotary_scaling, copy_adapter, split
from .keywords import signature_keywords

__all__ = ["ModuleAdapter", "extra_steps"]


class ModuleAdapter(CallableAdapter):
    """An ``nn.Module`` with headwise's calling convention (see the module docstring); headwise's
    :class:`~headwise.MultiHeadAttention` included (cache path and rotary positions too).

    Shapes:
        module: (b, s, d) -> (b, s, d); heads: q_proj (h * d_h, d), k_proj / v_proj (h_kv * d_h, d)

    Example:
        >>> from headwise import MultiHeadAttention
        >>> ad = ModuleAdapter(MultiHeadAttention(16, 4, n_kv_heads=2))
        >>> ad.exposes_heads, ad.has_cache, (ad.n_heads, ad.n_kv_heads, ad.d_head)
        (True, True, (4, 2, 4))
    """

    def __init__(self, module: nn.Module, *, d_model: int | None = None, causal: bool = False,
                 name: str | None = None) -> None:
        d_model = getattr(module, "d_model", None) or _linear_in(module, "q_proj") or d_model
        if not d_model:
            raise ValueError(f"cannot infer d_model of {type(module).__name__}: pass d_model=")
        super().__init__(module, d_model=int(d_model), causal=causal, name=name or type(module).__name__)
        self.module = module
        kw, _ = signature_keywords(module.forward)
        check_rotary_scaling(getattr(module, "rotary", None), self.name)
        rotary, new_cache = getattr(module, "rotary", None) is not None, callable(getattr(module, "new_cache", None))
        self.positional = rotary and "positions" in kw
        self.has_cache = new_cache and "cache" in kw
        if self.open_keywords:
            self.unconfirmed |= {k for k, has in (("positions", rotary), ("cache", new_cache)) if has and k not in kw}
        self.own_steps = _is_headwise(module)
        if not self.own_steps:  # q, k and v rebuilt from the projections: what else it has may transform them
            applied = ("rotary",) if callable(getattr(getattr(module, "rotary", None), "rotate", None)) else ()
            self.qk_steps, self.v_steps = extra_steps(module, applied)
        self.qk_inferred = bool(self.qk_steps)
        projs = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
        n_heads = getattr(module, "n_heads", None)
        if all(isinstance(p, nn.Linear) for p in projs) and isinstance(n_heads, int) and not isinstance(n_heads, bool):
            self.no_heads_reason = self._heads(projs, n_heads, getattr(module, "n_kv_heads", None))
            self.exposes_heads = not self.no_heads_reason
        self._declared_scale(module)

    def _heads(self, projs: list[nn.Linear], n_heads: int, n_kv_heads: Any) -> str:
        """Set the head counts from the projections' widths; why heads cannot be exposed ("" when they are).
        Without an ``n_kv_heads`` attribute (a GQA layer may spell it ``num_kv_heads``) the K/V head count is
        ``k_proj``'s width over the query heads' width."""
        q, k, v, o = projs
        if n_heads < 1 or q.out_features % n_heads:
            return f"{self.name} exposes no heads: q_proj's {q.out_features} outputs do not split into n_heads={n_heads}"
        d_head = q.out_features // n_heads
        if n_kv_heads is None:
            n_kv_heads = k.out_features // d_head
        if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int) or n_kv_heads < 1 or n_heads % n_kv_heads:
            return f"{self.name} exposes no heads: n_kv_heads={n_kv_heads!r} does not divide n_heads={n_heads}"
        for name, proj in (("k_proj", k), ("v_proj", v)):
            if proj.out_features != n_kv_heads * d_head:
                return (f"{self.name} exposes no heads: {name} has {proj.out_features} outputs, not n_kv_heads * "
                        f"d_head = {n_kv_heads} * {d_head}")
        if o.in_features != n_heads * d_head:
            return (f"{self.name} exposes no heads: out_proj takes {o.in_features} inputs, not n_heads * d_head = "
                    f"{n_heads} * {d_head}")
        self.n_heads, self.n_kv_heads, self.d_head = n_heads, n_kv_heads, d_head
        return ""

    def _declared_scale(self, module: nn.Module) -> None:
        """headwise's layer declares its score scale (the ``scale=`` option) in its config: that is the scale
        expected, as a Hugging Face family's declared scale is."""
        from ..config import AttentionConfig

        cfg = getattr(module, "config", None)
        scale = getattr(cfg, "scale", None) if isinstance(cfg, AttentionConfig) else None
        if isinstance(scale, float) and scale > 0 and not math.isclose(scale, cfg.d_head ** -0.5, rel_tol=1e-12):
            self.scale, self.scale_source = scale, f"config.scale = {scale:g} (the layer's)"

    @property
    def dtype(self) -> torch.dtype:
        p = next(self.module.parameters(), None)
        return p.dtype if p is not None else torch.get_default_dtype()

    @property
    def device(self) -> torch.device:
        p = next(self.module.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def run(self, x, *, keep=None, causal=None, positions=None):
        kw = self._kwargs(keep, causal)
        if positions is not None:
            if not self.positional:
                raise ValueError(f"{self.name} takes no positions")
            kw["positions"] = positions
        return self.module(x, **kw)

    def run_weights(self, x, *, keep=None, causal=None):
        return self.module(x, return_weights=True, **self._kwargs(keep, causal))

    def qk(self, x):
        if not self.exposes_heads:
            return None
        m = self.module
        if self.own_steps:  # the layer's own steps: its QK-norms (QKNormAttention) and rotary included
            k, _ = m.project_kv(x)  # (b, h_kv, s, d_h)
            return m.rotate(m.project_q(x), k, torch.arange(x.shape[1], device=x.device))
        q = split(m.q_proj(x), self.n_heads)  # (b, h, s, d_h)
        k = split(m.k_proj(x), self.n_kv_heads)  # (b, h_kv, s, d_h)
        rotary = getattr(m, "rotary", None)
        if rotary is not None:
            if not callable(getattr(rotary, "rotate", None)):
                return None
            q, k = rotary.rotate(q, k, torch.arange(x.shape[1], device=x.device))
        return q, k

    def values(self, x):
        if not self.exposes_heads:
            return None
        if self.own_steps:
            return self.module.project_kv(x)[1]  # (b, h_kv, s, d_h)
        return split(self.module.v_proj(x), self.n_kv_heads)  # (b, h_kv, s, d_h)

    def contexts(self, x, *, causal=None):
        with capture_input(self.module.out_proj) as got:
            self.run(x, causal=causal)
        width = self.n_heads * self.d_head
        if not got or not isinstance(got[0], torch.Tensor) or tuple(got[0].shape) != (*x.shape[:2], width):
            seen = "never ran as a module (W_O applied another way, e.g. F.linear on its weight)" if not got else \
                f"got {tuple(got[0].shape) if isinstance(got[0], torch.Tensor) else type(got[0]).__name__}, not " \
                f"(b, s, n_heads * d_head) = {(*x.shape[:2], width)}"
            raise NotExposed(f"{self.name}'s out_proj {seen}: the per-head contexts, its input, cannot be read")
        return split(got[0], self.n_heads)  # (b, h, s, d_h)

    def head_slices(self, which, index):
        proj = {"q": self.module.q_proj, "k": self.module.k_proj, "v": self.module.v_proj}[which]
        lo, hi = index * self.d_head, (index + 1) * self.d_head
        out = [(proj.weight, 0, lo, hi)]
        if proj.bias is not None:
            out.append((proj.bias, 0, lo, hi))
        return out

    def decode(self, x, prefill):
        cache = self.module.new_cache(x.shape[0], x.shape[1])
        steps = [self.module(x[:, :prefill], cache=cache)]
        steps += [self.module(x[:, t:t + 1], cache=cache) for t in range(prefill, x.shape[1])]
        return torch.cat(steps, dim=1)

    def converted(self, dtype):
        return copy_adapter(self, dtype)


# Attributes the check applies itself (the projections) or that act on neither q, k nor v in eval mode.
_OWN = frozenset({"q_proj", "k_proj", "v_proj", "out_proj"})
_INERT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.Identity, nn.Softmax)
# What acts on q and k only, by the names layers give it: a per-head norm of the queries or keys (QK-norm), rotary
# positions; and a norm of the values, which acts on v only.
_QK_ONLY = re.compile(r"(q|k|query|key)s?_?(norm|layernorm|layer_norm|ln|rmsnorm|rms_norm)|(norm|ln)_?(q|k|query|key)"
                      r"|qk_?(norm|layernorm|layer_norm|ln)|rotary(_emb|_embedding|_pos_emb)?|rope|inv_freq"
                      r"|(cos|sin)_cached")
_V_ONLY = re.compile(r"(v|value)s?_?(norm|layernorm|layer_norm|ln|rmsnorm|rms_norm)|(norm|ln)_?(v|value)")


def extra_steps(module: nn.Module, applied: tuple[str, ...] = ()) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(qk_steps, v_steps)``: the submodules, parameters and buffers of ``module`` beyond its four projections, dropout,
    identities and softmaxes (none of which changes q, k or v in eval mode), that may act on its queries or keys
    before the scores (all but value norms and the ``applied`` ones) and between its values and W_O (all but
    QK-norms and rotary positions). A module with only its projections has neither: its q, k and v are what the
    projections give.

    Args:
        module: the layer.
        applied: names of submodules the adapter applies itself when it rebuilds q and k (its rotary).
    """
    names = [n for n, child in module.named_children() if n not in _OWN and not isinstance(child, _INERT)]
    names += [n for n, _ in module.named_parameters(recurse=False)]
    names += [n for n, _ in module.named_buffers(recurse=False)]  # an inline rotary's inv_freq, ALiBi's slopes
    qk = tuple(n for n in names if n not in applied and not _V_ONLY.fullmatch(n.lower()))
    v = tuple(n for n in names if not _QK_ONLY.fullmatch(n.lower()))
    return qk, v


def _is_headwise(module: nn.Module) -> bool:
    from ..attention import MultiHeadAttention  # on first use: the checks import no layer code until then

    return isinstance(module, MultiHeadAttention)


def _linear_in(module: nn.Module, name: str) -> int | None:
    lin = getattr(module, name, None)
    return lin.in_features if isinstance(lin, nn.Linear) else None
