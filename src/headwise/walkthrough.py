"""A step-by-step walk through one attention layer, recording each tensor's shape, strides and whether
the step made a view (same memory) or a new tensor. Used by ``headwise tour`` and ``headwise explain``.

Shapes:
    b: batch, s: sequence, h: query heads, h_kv: key/value heads, d: d_model, d_h: d_head.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .attention import MultiHeadAttention
from .config import AttentionConfig

__all__ = ["Step", "walk", "head_by_head_error"]


@dataclass(frozen=True)
class Step:
    """One step of the walk: ``kind`` is ``"view"`` (shares the previous tensor's memory) or ``"new"``."""

    name: str
    code: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    kind: str
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _kind(t: torch.Tensor, src: torch.Tensor) -> str:
    # A view shares its base's storage; on meta tensors there is no memory to compare, but autograd's
    # view tracking (``_base``) is the same on every device.
    base = src._base if src._base is not None else src
    return "view" if t._base is not None and t._base is base else "new"


def walk(config: AttentionConfig, *, seq_len: int = 128, batch: int = 1, device: str | torch.device | None = None,
         dtype: torch.dtype | None = None, attn: MultiHeadAttention | None = None,
         seed: int = 0) -> list[Step]:
    """Run one self-attention forward by hand, step by step, and record what each step did.

    Use ``device="meta"`` for sizes too large to allocate: shapes, strides and view/copy are exact, no
    arithmetic is done.

    Args:
        config: the layer's configuration; a self-attention one (``kdim == vdim == d_model``).
        seq_len: the sequence length s of the walked input.
        batch: its batch size b.
        device: where the input (and the layer, when ``attn`` is None) lives; None: ``attn``'s device, or the CPU.
        dtype: the input's (and the layer's) floating dtype; None: ``attn``'s dtype, or float32.
        attn: a layer of ``config`` to walk through; None builds one from ``seed``.
        seed: the seed of the layer built when ``attn`` is None.

    Shapes:
        x: (b, s, d) -> q: (b, h, s, d_h); k, v: (b, h_kv, s, d_h); scores: (b, h, s, s) -> (b, s, d)

    Example:
        >>> steps = walk(AttentionConfig(d_model=4096, n_heads=32), seq_len=128, device="meta")
        >>> [(s.name, s.shape, s.kind) for s in steps][2:4]
        [('split Q: view', (1, 128, 32, 128), 'view'), ('split Q: transpose', (1, 32, 128, 128), 'view')]
    """
    if not isinstance(config, AttentionConfig):
        raise TypeError(f"walk: config must be an AttentionConfig, got {type(config).__name__}")
    for name, value in (("seq_len", seq_len), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"walk: {name} must be an int, got {type(value).__name__} ({value!r})")
        if value < 1:
            raise ValueError(f"walk: {name} must be a positive int, got {value}")
    if attn is not None and (not isinstance(attn, MultiHeadAttention) or attn.config != config):
        got = f"a layer of config {attn.config}" if isinstance(attn, MultiHeadAttention) else type(attn).__name__
        raise ValueError(f"walk: attn must be a MultiHeadAttention of this config, got {got}")
    if config.kdim != config.d_model or config.vdim != config.d_model:
        raise ValueError(f"walk: a self-attention walk needs kdim == vdim == d_model={config.d_model}, got "
                         f"kdim={config.kdim}, vdim={config.vdim}")
    if attn is not None:  # x is built where the layer's weights are, in their dtype
        w = attn.q_proj.weight
        want = None if device is None else torch.device(device)  # "cuda" names cuda:0 as well: index if given
        if (dtype is not None and dtype != w.dtype) or (want is not None and (
                want.type != w.device.type or want.index is not None and want.index != w.device.index)):
            raise ValueError(f"walk: dtype={dtype}, device={device} do not match attn's weights ({w.dtype} on "
                             f"{w.device}); leave them None to use attn's")
        dtype, device = w.dtype, w.device
    dtype, device = dtype or torch.float32, device or "cpu"
    b, s, h, h_kv, d_h = batch, seq_len, config.n_heads, config.n_kv_heads, config.d_head
    if attn is None:
        torch.manual_seed(seed)
        attn = MultiHeadAttention.from_config(config, device=device, dtype=dtype)
    steps: list[Step] = []

    def rec(name: str, code: str, t: torch.Tensor, kind: str, note: str = "") -> torch.Tensor:
        steps.append(Step(name, code, tuple(t.shape), tuple(t.stride()), kind, note))
        return t

    with torch.no_grad():
        x = rec("input x", "x", torch.randn(b, s, config.d_model, device=device, dtype=dtype), "new")
        q = rec("Q = x W_Q", "q_proj(x)", attn.q_proj(x), "new", "one matmul for all heads")
        q4 = q.view(b, s, h, d_h)  # (b, s, h, d_h)
        rec("split Q: view", f"q.view(b, s, {h}, {d_h})", q4, _kind(q4, q), "relabels features as (head, d_head)")
        qh = q4.transpose(1, 2)  # (b, h, s, d_h)
        rec("split Q: transpose", "q.transpose(1, 2)", qh, _kind(qh, q4), "each head's (s, d_h) block")
        k = rec("K = x W_K", "k_proj(x)", attn.k_proj(x), "new", f"{h_kv} K/V head" + ("" if h_kv == 1 else "s"))
        kh = k.view(b, s, h_kv, d_h).transpose(1, 2)  # (b, h_kv, s, d_h)
        rec("split K", f"k.view(b, s, {h_kv}, {d_h}).transpose(1, 2)", kh, _kind(kh, k))
        v = attn.v_proj(x)
        vh = v.view(b, s, h_kv, d_h).transpose(1, 2)  # (b, h_kv, s, d_h)
        rec("split V", f"v.view(b, s, {h_kv}, {d_h}).transpose(1, 2)", vh, _kind(vh, v))
        g = config.group_size
        note = f"query head i reads K/V head i // {g}" if g > 1 else "one K/V head per query head"
        k_rep = kh.repeat_interleave(g, dim=1) if g > 1 else kh
        scores = rec("scores = Q K^T * scale", "q @ k.transpose(-2, -1) * scale",
                     (qh @ k_rep.transpose(-2, -1)) * config.scale, "new",
                     f"(b, h, s, s): materialised only by the eager path; {note}")
        probs = rec("softmax per head", "scores.softmax(-1)", scores.softmax(-1), "new", "one softmax per head")
        v_rep = vh.repeat_interleave(g, dim=1) if g > 1 else vh
        ctx = rec("context = P V", "probs @ v", probs @ v_rep, "new", "(b, h, s, d_h)")
        ctx_t = ctx.transpose(1, 2)  # (b, s, h, d_h)
        rec("merge: transpose back", "ctx.transpose(1, 2)", ctx_t, _kind(ctx_t, ctx))
        merged = ctx_t.reshape(b, s, h * d_h)  # (b, s, h * d_h)
        kind = _kind(merged, ctx)
        rec("merge: flatten heads", f"reshape(b, s, {h * d_h})", merged, kind,
            "a copy: the transposed tensor is not contiguous" if kind == "new"
            else "a view: the transposed tensor is laid out as (b, s, h * d_h) already")
        rec("y = concat W_O", "out_proj(merged)", attn.out_proj(merged), "new", "the only place heads mix")
    return steps


def head_by_head_error(attn: MultiHeadAttention, x: torch.Tensor) -> float:
    """Max |packed(x) - W_O(concat of every head run alone)|: rounding only, if heads are independent.

    Shapes:
        x: (b, s, d) -> a float

    Example:
        >>> attn = MultiHeadAttention(d_model=32, n_heads=4)
        >>> head_by_head_error(attn, torch.randn(2, 5, 32)) < 1e-5
        True
    """
    with torch.no_grad():
        packed = attn(x)
        alone = torch.cat([head(x) for head in attn.heads()], dim=-1)  # (b, s, h * d_h)
        return float((attn.out_proj(alone) - packed).abs().max())


def flatten_bug_error(ctx: torch.Tensor) -> float:
    """How far the classic bug (flatten ``(b, h, s, d_h)`` without transposing back) lands from the
    correct merge, for a context tensor ``ctx``. Same shape, different tensor.

    Shapes:
        ctx: (b, h, s, d_h) -> a float (both merges give (b, s, h * d_h))

    Example:
        >>> flatten_bug_error(torch.randn(1, 4, 3, 2)) > 0
        True
    """
    b, h, s, d_h = ctx.shape
    right = ctx.transpose(1, 2).reshape(b, s, h * d_h)  # (b, s, h * d_h)
    wrong = ctx.reshape(b, s, h * d_h)  # (b, s, h * d_h): same shape, token/head coordinates mixed
    return float((right - wrong).abs().max())
