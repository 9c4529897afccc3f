"""GPT-2 self-attention (``GPT2Attention``) <-> headwise.

GPT-2 projects with ``Conv1D``, which stores its weight as ``(in, out)`` and computes ``x @ W + b``:
the *transpose* of ``nn.Linear``'s ``(out, in)``. Q, K and V are packed into one ``c_attn`` of width
``3 * d`` (columns ``[0, d)`` are Q, ``[d, 2d)`` K, ``[2d, 3d)`` V); heads are consecutive ``d_h``-wide
column blocks inside each.

====================================  ==============  =================================
Hugging Face                          headwise        conversion
====================================  ==============  =================================
``c_attn.weight[:, 0:d]``             ``q_proj``      ``.T`` -> ``(d, d)`` (out, in)
``c_attn.weight[:, d:2d]``            ``k_proj``      ``.T``
``c_attn.weight[:, 2d:3d]``           ``v_proj``      ``.T``
``c_attn.bias`` (3 chunks)            ``*_proj.bias``
``c_proj.weight``                     ``out_proj``    ``.T``
``scaling``                           ``config.scale``  includes ``scale_attn_weights`` and
                                                        ``scale_attn_by_inverse_layer_idx``
``resid_dropout``                     (kept)          applied after ``out_proj`` by the patched module
====================================  ==============  =================================

A patched GPT-2 module keeps its ``Conv1D`` modules; its layer is a :class:`GPT2View` that runs ``c_attn``
once (one fused GEMM, then the split, as HF does) and ``c_proj`` itself, and whose ``q_proj`` .. ``out_proj``
(what ``attn.head(i)`` reads) are transposed column views of ``c_attn`` / ``c_proj``: no copy, so an edit
through a head is an edit of the model. Cross-attention (``is_cross_attention=True``) is not
converted. ``reorder_and_upcast_attn`` only changes float16/bfloat16 rounding in HF's eager path; headwise
always computes the eager softmax in float32 for those dtypes.

Shapes:
    b: batch, s: sequence, h: heads, d: model width (n_embd), d_h: head width.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import functional as hwf
from ..attention import MultiHeadAttention, has_forward_hooks
from ..config import AttentionConfig
from ._hf_common import check_same, copy_into, hf_attend, new_copy, pop_cache
from ._view import LayerView, ProjectionView
from .hf_seam import SurgerySeam, set_counts

__all__ = ["classes", "from_module", "load_into", "split_c_attn", "GPT2View", "PatchedGPT2"]

KEY = "gpt2"
NAME = "GPT-2 (GPT2Attention: Conv1D c_attn/c_proj)"


def classes() -> tuple[type, ...]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    return (GPT2Attention,)


def _check_conv1d(owner: str, name: str, layer: object, d_in: int, d_out: int) -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    if not isinstance(layer, Conv1D):
        raise TypeError(f"{owner}.{name} must be a transformers Conv1D, got {type(layer).__name__}")
    got = tuple(layer.weight.shape)
    if got != (d_in, d_out):
        hint = " (that is nn.Linear's (out, in) order; Conv1D stores (in, out))" if got == (d_out, d_in) else ""
        raise ValueError(f"{owner}.{name}.weight must have Conv1D shape (in={d_in}, out={d_out}), got {got}{hint}")
    if layer.bias is None or tuple(layer.bias.shape) != (d_out,):
        got_b = None if layer.bias is None else tuple(layer.bias.shape)
        raise ValueError(f"{owner}.{name}.bias must have shape ({d_out},), got {got_b}")
    return layer


def config_of(module: nn.Module) -> AttentionConfig:
    """The :class:`AttentionConfig` of a ``GPT2Attention``, both Conv1D shapes checked.

    Shapes:
        c_attn.weight (d, 3d), c_attn.bias (3d,), c_proj.weight (d, d), c_proj.bias (d,): Conv1D (in, out)
    """
    owner = type(module).__name__
    if getattr(module, "is_cross_attention", False):
        raise NotImplementedError(f"{owner} is a cross-attention block (is_cross_attention=True, has q_attn); "
                                  "headwise.interop converts GPT-2 self-attention only")
    d, h = module.embed_dim, module.num_heads
    inner = h * module.head_dim  # d, unless headwise.surgery removed heads (num_heads and split_size follow)
    _check_conv1d(owner, "c_attn", module.c_attn, d, 3 * inner)
    _check_conv1d(owner, "c_proj", module.c_proj, inner, d)
    return AttentionConfig(d_model=d, n_heads=h, d_head=module.head_dim, bias=True, out_bias=True,
                           dropout=float(module.attn_dropout.p), scale=float(module.scaling))


def split_c_attn(module: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``nn.Linear``-oriented ``(weight (out, in), bias)`` of Q, K, V and W_O, from the Conv1D layout.

    Shapes:
        c_attn.weight (d, 3d) -> q/k/v weight (d, d) each; c_proj.weight (d, d) -> out weight (d, d), transposed
    """
    d = module.num_heads * module.head_dim  # the heads' width (embed_dim unless heads were removed)
    w, b = module.c_attn.weight, module.c_attn.bias
    out = {name: (w[:, i * d:(i + 1) * d].T, b[i * d:(i + 1) * d])  # (d_out, d_in): Linear order
           for i, name in enumerate(("q_proj", "k_proj", "v_proj"))}
    out["out_proj"] = (module.c_proj.weight.T, module.c_proj.bias)  # (d_out, d_in)
    return out


def _backend(module: nn.Module) -> str:
    return "eager" if getattr(module.config, "_attn_implementation", None) == "eager" else "sdpa"


def from_module(module: nn.Module, *, share: bool = False, rotary_emb: nn.Module | None = None) -> MultiHeadAttention:
    """Convert one ``GPT2Attention``: a standalone copy (weights transposed to ``(out, in)``), or
    (``share=True``) a :class:`GPT2View` of its ``Conv1D`` weights.

    Shapes:
        GPT2Attention (d, h) -> MultiHeadAttention(d, h), weights (out, in)
    """
    cfg = config_of(module)
    if share:
        return GPT2View.build(cfg, module, backend=_backend(module))
    return new_copy(cfg, split_c_attn(module), rotary=None, backend=_backend(module), like=module.c_attn.weight,
                    training=module.training)


def host_of(module: nn.Module) -> tuple[nn.Module, str]:
    """The module :func:`patch` turns into a headwise one (the module itself), and its path below it."""
    return module, ""


def is_target(module: nn.Module) -> bool:
    """A ``GPT2Attention`` that :func:`patch` should take over (self-attention)."""
    return isinstance(module, classes()) and not getattr(module, "is_cross_attention", False)


def load_into(module: nn.Module, attn: MultiHeadAttention) -> None:
    """Write ``attn``'s weights into a ``GPT2Attention`` of the same shape, transposing into Conv1D order.

    Shapes:
        q/k/v_proj.weight (d, d) each -> c_attn.weight (d, 3d); out_proj.weight (d, d) -> c_proj.weight (d, d)
    """
    owner = type(module).__name__
    check_same(owner, config_of(module), attn.config)
    w = torch.cat([attn.q_proj.weight.T, attn.k_proj.weight.T, attn.v_proj.weight.T], dim=1)  # (d, 3d)
    b = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])  # (3d,)
    copy_into(module.c_attn.weight, w, f"{owner}.c_attn.weight")
    copy_into(module.c_attn.bias, b, f"{owner}.c_attn.bias")
    copy_into(module.c_proj.weight, attn.out_proj.weight.T, f"{owner}.c_proj.weight")
    copy_into(module.c_proj.bias, attn.out_proj.bias, f"{owner}.c_proj.bias")


class GPT2View(SurgerySeam, LayerView):
    """The headwise layer of a patched ``GPT2Attention``: ``c_attn`` / ``c_proj`` run as they are (so PEFT
    wrappers on them run too); ``q_proj`` .. ``out_proj`` are ``(out, in)`` views of their weights.

    Shapes:
        q/k/v_proj.weight: c_attn.weight[:, i * d:(i + 1) * d].T (d, d); out_proj.weight: c_proj.weight.T (d, d)
    """

    def resolve(self, name: str) -> ProjectionView:
        host, d = self._hw_host, self.config.inner_dim
        if name == "out_proj":
            return ProjectionView(lambda: host.c_proj.weight.T, lambda: host.c_proj.bias,  # (d_out, d_in)
                                  call=lambda x: host.c_proj(x), what="c_proj.weight.T")
        i = ("q_proj", "k_proj", "v_proj").index(name)
        cols = slice(i * d, (i + 1) * d)
        return ProjectionView(lambda: host.c_attn.weight[:, cols].T, lambda: host.c_attn.bias[cols],  # (d_out, d_in)
                              what=f"c_attn.weight[:, {i * d}:{(i + 1) * d}].T")

    def sources(self) -> list[tuple[str, nn.Module]]:
        return [("c_attn", self._hw_host.c_attn), ("c_proj", self._hw_host.c_proj)]

    def source_names(self) -> dict[str, str]:
        d = self.config.inner_dim
        names = {n: f"c_attn[{i * d}:{(i + 1) * d}]" for i, n in enumerate(("q_proj", "k_proj", "v_proj"))}
        return {**names, "out_proj": "c_proj"}

    def write_heads(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]], n_heads: int,
                    n_kv_heads: int, heads_from: Any = None) -> None:
        """New ``Conv1D`` ``c_attn`` (Q, K, V columns side by side) and ``c_proj`` holding ``weights`` (the surgery
        seam, :mod:`~headwise.interop.hf_seam`), and the ``num_heads`` / ``split_size`` the forward reads.

        Shapes:
            q/k/v_proj (h * d_h, d) -> c_attn.weight (d, 3 h d_h); out_proj (d, h * d_h) -> c_proj.weight (h d_h, d)
        """
        from transformers.pytorch_utils import Conv1D

        self.refuse_edit(n_heads, n_kv_heads)
        host, inner = self._hw_host, n_heads * self.d_head
        (qw, qb), (kw, kb), (vw, vb), (ow, ob) = (weights[p] for p in ("q_proj", "k_proj", "v_proj", "out_proj"))
        for name, w, b in (("c_attn", torch.cat([qw.T, kw.T, vw.T], dim=1), torch.cat([qb, kb, vb])),  # (d, 3 h d_h)
                           ("c_proj", ow.T, ob)):  # (h d_h, d)
            old = getattr(host, name)
            with torch.device("meta"):  # no allocation: the parameters are replaced at once
                new = Conv1D(w.shape[1], w.shape[0])
            new.weight = nn.Parameter(w.detach().contiguous().clone(), requires_grad=old.weight.requires_grad)
            new.bias = nn.Parameter(b.detach().clone(), requires_grad=old.weight.requires_grad)
            setattr(host, name, new.train(old.training))
        host.split_size = inner
        set_counts(host, self.surgery_entry(), n_heads, n_kv_heads, self.d_head)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One ``c_attn`` call, split into heads. Shapes: x (b, s, d) -> (b, h, s, d_h) x3."""
        cfg = self.config
        return hwf.split_qkv(self._hw_host.c_attn(x), cfg.n_heads, cfg.n_kv_heads)  # (b, h, s, d_h) each

    def project_out(self, context: torch.Tensor, results: torch.Tensor | None = None) -> torch.Tensor:
        """Merge heads and run ``c_proj``; with ``results`` (every head's write, from a trace) while ``c_proj``
        is HF's plain ``Conv1D`` without hooks, their sum plus its bias: the same value, no second product.

        Shapes: context (b, h, s, d_h); results (b, s, h, d) -> (b, s, d)"""
        c_proj = self._hw_host.c_proj
        if results is not None and type(c_proj).__name__ == "Conv1D" and not has_forward_hooks(c_proj):
            return results.sum(2) + c_proj.bias  # (b, s, d)
        return c_proj(hwf.merge_heads(context))  # (b, s, d)


class PatchedGPT2:
    """Forward of a patched ``GPT2Attention``: HF's signature and ``(output, weights)`` return.

    Shapes:
        hidden_states: (b, s, d); attention_mask: (b, 1, s, s_kv) or None -> (b, s, d), weights or None
    """

    def forward(self, hidden_states: torch.Tensor, cache: Any = None, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: Any = None,
                output_attentions: bool | None = False, **kwargs: Any):
        cache = pop_cache(cache, kwargs)
        if encoder_hidden_states is not None:
            raise NotImplementedError("a patched GPT2Attention is self-attention only; cross-attention layers "
                                      "are left unpatched")
        if output_attentions:
            kwargs["output_attentions"] = True
        attn = self.attn
        q, k, v = attn.project_qkv(hidden_states)  # (b, h, s, d_h) each
        if cache is not None:
            current = getattr(cache, "self_attention_cache", cache)  # EncoderDecoderCache with cross-attention
            k, v = current.update(k, v, self.layer_idx, kwargs=kwargs)
        out, weights = hf_attend(self, q, k, v, attention_mask, kwargs)
        results = None if attn.tracer is None else attn.tracer.results(attn)  # a trace's per-head writes
        return self.resid_dropout(attn.project_out(out, results)), weights
