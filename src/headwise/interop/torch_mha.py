"""Conversions between ``torch.nn.MultiheadAttention`` and headwise's :class:`MultiHeadAttention`.

``nn.MultiheadAttention`` stores W_Q, W_K, W_V either packed in one ``in_proj_weight`` ``(3d, d)`` (when
``kdim == vdim == embed_dim``) or as three separate matrices ``q_proj_weight`` ``(d, d)``,
``k_proj_weight`` ``(d, kdim)``, ``v_proj_weight`` ``(d, vdim)``; the biases are always packed in
``in_proj_bias`` ``(3d,)``. headwise keeps one ``nn.Linear`` per projection; both store weights as
``(out, in)``, so the conversion is a row split of ``in_proj_weight`` and nothing is transposed.

Calling conventions differ in three places, all handled by :func:`torch_masks_to_headwise`:

* ``key_padding_mask`` (bool): True = **ignore** the key; headwise bool masks are True = **may attend**.
* ``attn_mask`` (bool): True = **not allowed**; again the opposite of headwise. Float masks are added to the
  scores in both libraries. A 3-D ``attn_mask`` ``(b * h, s_q, s_kv)`` becomes ``(b, h, s_q, s_kv)``.
* ``is_causal=True`` is only a hint that ``attn_mask`` is the causal mask; headwise's ``causal=True`` is
  the same mask when ``s_q == s_kv`` (headwise aligns causal masks bottom-right when ``s_q != s_kv``).

:func:`from_torch` copies by default; ``share=True`` returns a :class:`TorchMHAView` instead, a layer whose
projections are views of ``m``'s own parameters (``in_proj_weight`` rows, ``out_proj``): gradients reach
them and an optimizer step on either module is seen by both.

The layer returned by :func:`from_torch` is always batch-first: transpose ``(s, b, d)`` inputs of a
``batch_first=False`` module to ``(b, s, d)``. It returns per-head weights ``(b, h, s_q, s_kv)``; torch's
``average_attn_weights=True`` is their mean over heads, ``weights.mean(1)``.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: heads, d: model width (``embed_dim``),
    d_h: head width.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from torch.nn import functional as F
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .. import functional as hwf
from ..attention import MultiHeadAttention
from ..config import AttentionConfig
from ..masks import combine_masks, padding_mask
from ..module_calls import FORWARD_STEPS, adapter_base
from ..validation import check_bool
from .views import LayerView, ProjectionView

__all__ = ["from_torch", "to_torch", "torch_masks_to_headwise", "TorchMHAView"]


def from_torch(m: nn.MultiheadAttention, *, backend: str = "sdpa", share: bool = False) -> MultiHeadAttention:
    """A headwise layer with ``m``'s weights (copied), biases, dropout, kdim/vdim, dtype and device.

    The result is batch-first whatever ``m.batch_first`` is, and in ``m``'s train/eval mode.
    ``add_bias_kv`` and ``add_zero_attn`` have no headwise equivalent and raise ``ValueError``.
    With ``share=True`` nothing is copied: the result is a :class:`TorchMHAView` of ``m``'s parameters
    (its ``parameters()`` are ``m``'s; its train/eval flag is ``m``'s).

    Shapes:
        in_proj_weight (3d, d) -> q_proj, k_proj, v_proj weights (d, d) each;
        or q_proj_weight (d, d), k_proj_weight (d, kdim), v_proj_weight (d, vdim);
        in_proj_bias (3d,) -> three (d,) biases; out_proj (d, d) -> out_proj.
        Calls: attn(x) (b, s, d) -> (b, s, d); attn(q, key=k, value=v) with k (b, s_kv, kdim), v (b, s_kv, vdim).

    Example:
        >>> m = nn.MultiheadAttention(16, 4, batch_first=True).eval()
        >>> attn = from_torch(m)
        >>> x = torch.randn(2, 5, 16)
        >>> torch.testing.assert_close(attn(x), m(x, x, x, need_weights=False)[0])
        >>> view = from_torch(m, share=True)
        >>> view.head(1).w_q.data_ptr() == m.in_proj_weight[4:8].data_ptr()
        True
    """
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"from_torch expects a torch.nn.MultiheadAttention, got {type(m).__name__}")
    check_bool("share", share)
    unsupported = []
    if m.bias_k is not None or m.bias_v is not None:
        unsupported.append("add_bias_kv=True (learned bias_k/bias_v appended as an extra key/value)")
    if m.add_zero_attn:
        unsupported.append("add_zero_attn=True (an extra all-zero key/value)")
    if unsupported:
        raise ValueError("headwise does not model these nn.MultiheadAttention features: "
                         + "; ".join(unsupported) + ". Rebuild the module without them to convert it.")
    d, h = m.embed_dim, m.num_heads
    has_bias = m.in_proj_bias is not None
    config = AttentionConfig(d_model=d, n_heads=h, bias=has_bias, out_bias=m.out_proj.bias is not None,
                             dropout=float(m.dropout), kdim=m.kdim, vdim=m.vdim)
    if share:
        return TorchMHAView.build(config, m, backend=backend, keep=True)  # the view is what holds m
    if m._qkv_same_embed_dim:
        w = m.in_proj_weight
        w_q, w_k, w_v = w[:d], w[d:2 * d], w[2 * d:]
    else:
        w_q, w_k, w_v = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    attn = MultiHeadAttention.from_config(config, backend=backend, device=w_q.device, dtype=w_q.dtype)
    with torch.no_grad():
        for proj, weight in ((attn.q_proj, w_q), (attn.k_proj, w_k), (attn.v_proj, w_v)):
            proj.weight.copy_(weight)
        if has_bias:
            b = m.in_proj_bias
            for proj, bias in ((attn.q_proj, b[:d]), (attn.k_proj, b[d:2 * d]), (attn.v_proj, b[2 * d:])):
                proj.bias.copy_(bias)
        attn.out_proj.weight.copy_(m.out_proj.weight)
        if m.out_proj.bias is not None:
            attn.out_proj.bias.copy_(m.out_proj.bias)
    attn.train(m.training)
    return attn


def to_torch(attn: MultiHeadAttention, *, batch_first: bool = True) -> nn.MultiheadAttention:
    """An ``nn.MultiheadAttention`` with ``attn``'s weights (copied), dtype, device and train/eval mode.

    Packed ``in_proj_weight`` when ``kdim == vdim == d_model``, else separate ``q/k/v_proj_weight``
    (torch decides the layout from kdim/vdim). Layers torch cannot express raise ``ValueError``:
    GQA/MQA, ``n_heads * d_head != d_model``, ``out_bias != bias``, a non-default scale, rotary, per-head
    Q/K norms, a projection that is not an ``nn.Linear`` (a LoRA wrapper or another module; for a view, the module
    the projection reads, GPT-2's ``c_proj`` among them; hooks are not copied)
    or whose bias is present where the config's ``bias``/``out_bias`` says none (or the reverse), and any subclass
    or instance attribute that overrides a step of the forward (``forward``, ``project_q``, ``project_kv``,
    ``project_qkv``, ``rotate``, ``attend``, ``project_out``), naming it.

    Shapes:
        q_proj, k_proj, v_proj weights (d, d), (d, kdim), (d, vdim) -> in_proj_weight (3d, d) or
        q_proj_weight, k_proj_weight, v_proj_weight; biases -> in_proj_bias (3d,).

    Example:
        >>> attn = MultiHeadAttention(d_model=16, n_heads=4)
        >>> m = to_torch(attn)
        >>> m.in_proj_weight.shape, m.batch_first
        (torch.Size([48, 16]), True)
        >>> bool(torch.equal(m.in_proj_weight[16:32], attn.k_proj.weight))
        True
    """
    if not isinstance(attn, MultiHeadAttention):
        raise TypeError(f"to_torch expects a headwise MultiHeadAttention, got {type(attn).__name__}")
    check_bool("batch_first", batch_first)
    cfg = attn.config
    problems = []
    if cfg.n_kv_heads != cfg.n_heads:
        problems.append(f"{cfg.kind} (n_kv_heads={cfg.n_kv_heads} != n_heads={cfg.n_heads}); "
                        "nn.MultiheadAttention has one K/V head per query head")
    if cfg.inner_dim != cfg.d_model:
        problems.append(f"n_heads * d_head = {cfg.n_heads} * {cfg.d_head} = {cfg.inner_dim} != d_model={cfg.d_model}; "
                        "nn.MultiheadAttention needs d_head = d_model / n_heads")
    if cfg.out_bias != cfg.bias:
        problems.append(f"out_bias={cfg.out_bias} != bias={cfg.bias}; nn.MultiheadAttention has one bias flag")
    if not math.isclose(cfg.scale, cfg.d_head ** -0.5, rel_tol=1e-12):
        problems.append(f"scale={cfg.scale} != 1/sqrt(d_head)={cfg.d_head ** -0.5}; nn.MultiheadAttention "
                        "always scales by 1/sqrt(d_head)")
    if attn.rotary is not None:
        problems.append("rotary position embeddings; nn.MultiheadAttention has none")
    problems += _forward_problems(attn)
    if problems:
        raise ValueError("cannot express this layer as nn.MultiheadAttention: " + "; ".join(problems))
    w = attn.q_proj.weight
    m = nn.MultiheadAttention(cfg.d_model, cfg.n_heads, dropout=cfg.dropout, bias=cfg.bias, kdim=cfg.kdim,
                              vdim=cfg.vdim, batch_first=batch_first, device=w.device, dtype=w.dtype)
    d = cfg.d_model
    with torch.no_grad():
        if m._qkv_same_embed_dim:
            m.in_proj_weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        else:
            m.q_proj_weight.copy_(attn.q_proj.weight)
            m.k_proj_weight.copy_(attn.k_proj.weight)
            m.v_proj_weight.copy_(attn.v_proj.weight)
        if cfg.bias:
            m.in_proj_bias[:d].copy_(attn.q_proj.bias)
            m.in_proj_bias[d:2 * d].copy_(attn.k_proj.bias)
            m.in_proj_bias[2 * d:].copy_(attn.v_proj.bias)
            m.out_proj.bias.copy_(attn.out_proj.bias)
        m.out_proj.weight.copy_(attn.out_proj.weight)
    m.train(attn.training)
    return m


# Overrides of the forward steps (module_calls.FORWARD_STEPS) known to compute the plain function: the fused QKV
# GEMM of the views (same Q, K, V as three GEMMs).
_PLAIN_OVERRIDES = {("LayerView", "project_qkv"), ("TorchMHAView", "project_qkv")}
_PLAIN_TYPES = (nn.Linear, NonDynamicallyQuantizableLinear)


def _odd_projections(attn: MultiHeadAttention) -> dict[str, str]:
    """``{projection: what it is}`` for each projection whose call computes more than ``F.linear`` of the weight
    and bias to_torch copies: a LoRA wrapper's delta, a forward set on the instance, another module.

    A view's projection is its host's module, a ``ProjectionView`` calling it (GPT-2's ``Conv1D``) or rows of a
    fused Q/K/V: each is judged by the module it reads (``sources()``), not by the view's type. Hooks are not the
    module's computation (a profiler's global hooks among them): like a ``state_dict``, the copy does not carry them.
    """
    sources = dict(attn.sources()) if isinstance(attn, LayerView) else {}
    names = attn.source_names() if callable(getattr(attn, "source_names", None)) else {}
    where = getattr(attn, "host_name", "") or (type(attn.host).__name__ if sources else "")
    odd = {}
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        proj = getattr(attn, name, None)
        read = sources.get(name, proj)  # the module a view reads; a plain layer's projection is its own
        if isinstance(read, ProjectionView):
            continue  # nn.MultiheadAttention's rows (a TorchMHAView's): F.linear of them
        what = f"{type(read).__module__}.{type(read).__qualname__}"
        if adapter_base(read) is not None:
            what += " (an adapter, whose delta is not in the weight to_torch copies)"
        elif "forward" in getattr(read, "__dict__", {}):
            what += " with a forward set on the instance"
        elif type(read) in _PLAIN_TYPES or (read is not proj and type(read).__name__ == "Conv1D"
                                             and type(read).__module__ == "transformers.pytorch_utils"):
            continue  # transformers' Conv1D, which a view calls through its transposed weight: x @ W + b
        odd[name] = (f"{where}'s {names.get(name, name)}, a " if where else "") + what
    return odd


def _forward_problems(attn: MultiHeadAttention) -> list[str]:
    """What in ``attn``'s forward, beyond its config and rotary, ``nn.MultiheadAttention`` cannot compute."""
    problems = []
    odd = _odd_projections(attn)
    if odd:
        problems.append("projections that are not an nn.Linear's F.linear (" + ", ".join(
            f"{k}={v}" for k, v in odd.items()) + "); nn.MultiheadAttention applies only "
            "their weight and bias (merge an adapter first, e.g. PEFT's merge_and_unload())")
    # nn.MultiheadAttention has a bias everywhere or nowhere, built from the config's flag: a swapped-in projection
    # whose bias disagrees would have its bias dropped, or have none to copy.
    flags = {"q_proj": "bias", "k_proj": "bias", "v_proj": "bias", "out_proj": "out_bias"}
    has = {name: getattr(attn, name).bias is not None for name in flags if name not in odd}
    wrong = [f"{name} has {'a bias' if b else 'no bias'} but {flags[name]}={not b}" for name, b in has.items()
             if b != getattr(attn.config, flags[name])]
    if wrong:
        problems.append(f"projection biases that disagree with the config ({'; '.join(wrong)}); "
                        "nn.MultiheadAttention gives every projection a bias or none, as the config says")
    norms = {name: getattr(attn, name, None) for name in ("q_norm", "k_norm")}
    if any(isinstance(n, nn.Module) for n in norms.values()):
        problems.append("per-head Q/K norms (" + ", ".join(f"{k}={type(v).__name__}" for k, v in norms.items())
                        + "); nn.MultiheadAttention projects Q and K with no norm")
    # A view of a host module (HFView) forwards as the plain class unless standalone_refusal says why it cannot.
    refusal = getattr(attn, "standalone_refusal", None)
    why = refusal() if callable(refusal) else ""
    if why:
        problems.append(f"it computes more than the plain attention: {why}")
    overridden = []
    for step in FORWARD_STEPS:
        owner = next(c for c in type(attn).__mro__ if step in vars(c))
        plain = owner is MultiHeadAttention or (owner.__module__.startswith("headwise.")
                                                 and (owner.__name__, step) in _PLAIN_OVERRIDES)
        if step == "forward" and callable(refusal) and "standalone_refusal" in vars(owner):
            plain = True  # that class's forward is the plain one, or the refusal handled above
        if not plain:
            overridden.append(f"{owner.__name__}.{step}")
    # A step assigned on the instance (a notebook's monkeypatch) shadows every class's.
    overridden += [f"{step} (set on the instance)" for step in FORWARD_STEPS if step in vars(attn)]
    if overridden:
        problems.append(f"{type(attn).__name__} overrides the forward steps {', '.join(overridden)}; "
                        "nn.MultiheadAttention computes only the plain MultiHeadAttention forward")
    return problems


class TorchMHAView(LayerView):
    """A headwise layer that is a view of an ``nn.MultiheadAttention``'s parameters (``from_torch(m, share=True)``).

    ``q_proj``/``k_proj``/``v_proj`` are row blocks of ``in_proj_weight`` (or the separate
    ``q/k/v_proj_weight``) and of ``in_proj_bias``; ``out_proj`` is ``m.out_proj`` itself. With a packed
    ``in_proj_weight``, self-attention projects Q, K, V in one GEMM, as torch does.

    Shapes:
        q_proj.weight (d, d), k_proj.weight (d, kdim), v_proj.weight (d, vdim), out_proj.weight (d, d)
    """

    def resolve(self, name: str) -> object:
        m, d = self._hw_host.ref(), self.config.d_model  # held strongly (build's keep): a C call, as in project_qkv
        if name == "out_proj":
            return m.out_proj
        i = ("q_proj", "k_proj", "v_proj").index(name)
        rows = slice(i * d, (i + 1) * d)
        bias = (lambda: None) if m.in_proj_bias is None else (lambda: m.in_proj_bias[rows])  # (d,)
        if m._qkv_same_embed_dim:
            return ProjectionView(lambda: m.in_proj_weight[rows], bias,
                                  what=f"in_proj_weight[{rows.start}:{rows.stop}]")
        return ProjectionView(lambda: getattr(m, f"{name}_weight"), bias, what=f"{name}_weight")

    def sources(self) -> list[tuple[str, nn.Module]]:
        return [("mha", self.host)]

    def source_names(self) -> dict[str, str]:
        d = self.config.d_model
        if self.host._qkv_same_embed_dim:
            names = {n: f"in_proj_weight[{i * d}:{(i + 1) * d}]" for i, n in enumerate(("q_proj", "k_proj", "v_proj"))}
        else:
            names = {n: f"{n}_weight" for n in ("q_proj", "k_proj", "v_proj")}
        return {**names, "out_proj": "out_proj"}

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V in one GEMM when ``in_proj_weight`` is packed. Shapes: x (b, s, d) -> (b, h, s, d_h) x3."""
        m = self._hw_host.ref()  # held strongly (build's keep): a C call, no Python frame in the forward
        if not m._qkv_same_embed_dim:
            return super().project_qkv(x)
        cfg = self.config
        qkv = F.linear(x, m.in_proj_weight, m.in_proj_bias)  # (b, s, 3 * d)
        return hwf.split_qkv(qkv, cfg.n_heads, cfg.n_kv_heads)  # (b, h, s, d_h) each


def torch_masks_to_headwise(
    attn_mask: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None, *,
    n_heads: int | None = None, query: torch.Tensor | None = None, key: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Turn ``nn.MultiheadAttention``'s ``attn_mask`` and ``key_padding_mask`` into one headwise mask.

    Bool masks flip polarity (torch: True = blocked / ignored; headwise: True = may attend); float masks
    are additive in both and pass through. Two bool masks give a bool mask; any float mask gives an
    additive one (blocked = ``-inf``), as torch merges them. A 3-D ``attn_mask`` ``(b * h, s_q, s_kv)``
    needs ``n_heads``. ``is_causal`` needs no conversion: pass ``causal=True`` to headwise instead of the
    causal ``attn_mask`` (identical when ``s_q == s_kv``).

    Pass ``query`` (the batch-first query the mask is for) and ``key`` (without it the masks' own key axis is
    the key length, and a size-1 key axis under several queries is refused as a broadcast) to have both masks
    checked as torch checks them, so that none is broadcast where torch refuses it: ``key_padding_mask``
    ``(b, s_kv)`` for a batched query, ``(s_kv,)`` for an unbatched one; ``attn_mask`` ``(s_q, s_kv)``, or
    ``(b * h, s_q, s_kv)`` (``(h, s_q, s_kv)`` unbatched). Anything else raises ``ValueError`` naming the
    expected and the received shapes. Without ``query`` the query length cannot be checked (a size-1 query
    axis would broadcast over every query); the two masks' key axes must still agree.

    Shapes:
        attn_mask: (s_q, s_kv) or (b * h, s_q, s_kv); key_padding_mask: (b, s_kv) or (s_kv,) (unbatched)
        query: (b, s_q, d) or (s_q, d); key: (b, s_kv, kdim) or (s_kv, kdim)
        -> broadcastable to (b, h, s_q, s_kv), or None when both masks are None

    Example:
        >>> kpm = torch.tensor([[False, False, True]])            # torch: ignore key 2
        >>> causal = torch.ones(3, 3, dtype=torch.bool).triu(1)    # torch: True = not allowed
        >>> torch_masks_to_headwise(causal, kpm)[0, 0].int().tolist()
        [[1, 0, 0], [1, 1, 0], [1, 1, 0]]
    """
    masks = []
    if n_heads is not None and (isinstance(n_heads, bool) or not isinstance(n_heads, int)):
        raise TypeError(f"n_heads must be a positive int or None, got {n_heads!r} ({type(n_heads).__name__})")
    if n_heads is not None and n_heads <= 0:
        raise ValueError(f"n_heads must be a positive int, got {n_heads}")
    if attn_mask is not None:
        _check_mask("attn_mask", attn_mask)
    if key_padding_mask is not None:
        _check_mask("key_padding_mask", key_padding_mask)
    _check_shapes(attn_mask, key_padding_mask, n_heads, query, key)
    if attn_mask is not None:
        if attn_mask.dim() == 3:
            if n_heads is None:
                raise ValueError(f"a 3-D attn_mask {tuple(attn_mask.shape)} is (b * h, s_q, s_kv): pass n_heads=")
            if attn_mask.shape[0] % n_heads:
                raise ValueError(f"attn_mask has {attn_mask.shape[0]} rows in dim 0, not a multiple of "
                                 f"n_heads={n_heads} (expected (b * h, s_q, s_kv))")
            attn_mask = attn_mask.reshape(-1, n_heads, *attn_mask.shape[1:])  # (b, h, s_q, s_kv)
        elif attn_mask.dim() != 2:
            raise ValueError(f"attn_mask must be (s_q, s_kv) or (b * h, s_q, s_kv), got {tuple(attn_mask.shape)}")
        masks.append(~attn_mask if attn_mask.dtype == torch.bool else attn_mask)
    if key_padding_mask is not None:
        if key_padding_mask.dim() == 1:
            key_padding_mask = key_padding_mask.unsqueeze(0)  # unbatched: (1, s_kv)
        if key_padding_mask.dim() != 2:
            raise ValueError(f"key_padding_mask must be (b, s_kv) or (s_kv,), got {tuple(key_padding_mask.shape)}")
        if key_padding_mask.dtype == torch.bool:
            masks.append(padding_mask(keep=~key_padding_mask))  # (b, 1, 1, s_kv)
        else:
            masks.append(key_padding_mask[:, None, None, :])  # (b, 1, 1, s_kv)
    return combine_masks(*masks)


def _check_shapes(attn_mask: torch.Tensor | None, kpm: torch.Tensor | None, n_heads: int | None,
                  query: object, key: object) -> None:
    """The masks' shapes as ``nn.MultiheadAttention`` checks them: torch never broadcasts either mask, so a
    size-1 axis where it expects s_q, s_kv or b is refused here too rather than applied to every row."""
    if kpm is not None and attn_mask is not None and kpm.dim() >= 1 and attn_mask.dim() >= 1 \
            and kpm.shape[-1] != attn_mask.shape[-1]:
        raise ValueError(f"key_padding_mask {tuple(kpm.shape)} and attn_mask {tuple(attn_mask.shape)} must have "
                         f"the same key axis (s_kv, their last), got {kpm.shape[-1]} and {attn_mask.shape[-1]}")
    if query is None and key is None:
        return
    for name, t in (("query", query), ("key", key)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() not in (2, 3)):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be (b, s, d) or (s, d) (batch-first, as the headwise layer takes it), "
                             f"got {got}")
    q, k = query, key if key is not None else query
    if q is not None and (q.dim() != k.dim() or q.dim() == 3 and q.shape[0] != k.shape[0]):
        raise ValueError(f"query {tuple(q.shape)} and key {tuple(k.shape)} must both be batched with the same b, "
                         f"or both unbatched")
    batched = k.dim() == 3
    b, s_q = (k.shape[0] if batched else None), (q.shape[-2] if q is not None else None)
    shown = f"the key {tuple(k.shape)}" if key is not None else f"the query {tuple(q.shape)}"
    hint = "" if key is not None else " (pass key= to check the key axis)"
    s_kv = k.shape[-2] if key is not None else _key_axis(kpm, attn_mask, s_q)  # cross-attention keys may differ
    if kpm is not None:
        want = (b, s_kv) if batched else (s_kv,)
        if not batched and kpm.dim() != 1:
            raise ValueError(f"key_padding_mask {tuple(kpm.shape)} must be 1-D (s_kv,) for an unbatched query, "
                             f"got {shown}")
        if batched and kpm.dim() == 1:
            raise ValueError(f"key_padding_mask {tuple(kpm.shape)} is 1-D (s_kv,), for an unbatched query, but "
                             f"{shown} is batched: pass a (b={b}, s_kv={s_kv}) mask (torch rejects this pair too)")
        if batched and kpm.dim() == 2 and kpm.shape[0] != b:
            raise ValueError(f"key_padding_mask {tuple(kpm.shape)} has b={kpm.shape[0]} but {shown} has b={b}")
        if tuple(kpm.shape) != want:
            raise ValueError(f"key_padding_mask must be {'(b, s_kv)' if batched else '(s_kv,)'} = {want} for "
                             f"{shown}{hint}, got {tuple(kpm.shape)} (torch does not broadcast it either)")
    if attn_mask is not None and attn_mask.dim() in (2, 3):
        rows = s_q if s_q is not None else attn_mask.shape[-2]  # s_q is unknown without the query
        want = (rows, s_kv)
        if attn_mask.dim() == 3:
            lead = None if n_heads is None else n_heads * (b if batched else 1)
            want = (attn_mask.shape[0] if lead is None else lead, rows, s_kv)
        if tuple(attn_mask.shape) != want:
            what = "(s_q, s_kv)" if attn_mask.dim() == 2 else "(b * h, s_q, s_kv)"
            raise ValueError(f"attn_mask must be {what} = {want} for {shown}{hint}, got {tuple(attn_mask.shape)} "
                             f"(torch does not broadcast it either)")


def _key_axis(kpm: torch.Tensor | None, attn_mask: torch.Tensor | None, s_q: int | None) -> int | None:
    """The key length the masks give when no key says it: their own last axis, except a size-1 axis under
    several queries, which is a broadcast as often as one key (torch refuses the broadcast: pass ``key=``)."""
    given = next((m for m in (kpm, attn_mask) if m is not None and m.dim() >= 1), None)
    if given is None:
        return None
    if given.shape[-1] == 1 and s_q is not None and s_q > 1:
        raise ValueError(f"a mask of key axis 1 {tuple(given.shape)} with {s_q} queries: torch never broadcasts "
                         "a mask, so pass key= (the keys really have 1 position) or a mask over every key")
    return given.shape[-1]


def _check_mask(name: str, mask: object) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(f"{name} must be bool or floating, got {mask.dtype}")
