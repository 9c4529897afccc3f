"""Long forwards without autograd, in query chunks: the memory of K, V and the output, not of Q and context too.

Every query row of attention is independent of the others (each head's softmax runs along the keys), so the
queries can be processed a chunk of positions at a time: project the chunk's queries, attend over all keys,
apply W_O, write the chunk's rows of the output. Keys and values are projected once and read by every chunk.
An unchunked layer holds Q, K, V and the context together (4 x s x d floats; 1 GiB at s 16384, d 4096 in
float32); chunked, the forward holds K, V and the output plus one chunk's temporaries.

It runs only where it changes nothing but memory: without autograd (a backward would keep every chunk's
activations anyway), on the fused ``sdpa`` backend, without dropout, probabilities or a cache, and only when
the unchunked Q, K, V and context would exceed :data:`CHUNK_ABOVE_BYTES`. Results equal the unchunked
forward to float rounding (every row runs the same kernel on the same keys); see tests/test_chunking.py.

Causal chunks read keys only up to their last query (bottom-right aligned, as everywhere in headwise), so
no chunk touches keys none of its queries may read. A chunk's keys are a prefix every query reads in full
and a square diagonal block that is causal in the kernel's own (top-left = bottom-right when square) sense.
On CPU, without a mask, the two run as separate flash-kernel calls merged by their log-sum-exp, exactly the
kernel's work for one causal pass (PyTorch's CPU flash op returns the log-sum-exp; the public SDPA does not).
Elsewhere a chunk attends with an explicit bottom-right mask, which computes the masked half of each
diagonal block too: about ``chunk / s`` more attention work (6 % at s 16384, chunk 1024).

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width (d_model), d_h: head width (d_head), c: positions per chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import functional as hwf
from .rotary import apply_rotary

if TYPE_CHECKING:
    from .attention import MultiHeadAttention

__all__ = ["CHUNK_ABOVE_BYTES", "CHUNK_BYTES", "chunk_length", "forward_in_chunks", "lse_merge_available"]

#: Chunk a forward whose unchunked Q, K, V and context together would take more than this (512 MiB).
CHUNK_ABOVE_BYTES = 512 * 2**20
#: Target size of one chunk's queries (16 MiB): 1024 positions at b 1, d 4096 in float32.
CHUNK_BYTES = 16 * 2**20
#: Chunks are a multiple of this many positions (the CPU flash kernel's query block), and never shorter.
_ALIGN = 256


def chunk_length(attn: "MultiHeadAttention", b: int, s_q: int, s_kv: int, dtype: torch.dtype) -> int | None:
    """Positions per query chunk for a forward of these sizes, or None when it runs unchunked.

    Only the sizes decide here; :meth:`MultiHeadAttention.forward` also requires ``attn.chunk_queries``, no
    autograd, the ``sdpa`` backend, no dropout, no returned weights and no cache (see the module docstring).

    Shapes:
        x: (b, s_q, d); keys/values: (b, s_kv, d)

    Example:
        >>> from headwise import MultiHeadAttention
        >>> attn = MultiHeadAttention(d_model=4096, n_heads=32)
        >>> chunk_length(attn, 1, 8192, 8192, torch.float32) is None     # Q, K, V, context: 512 MiB
        True
        >>> chunk_length(attn, 1, 16384, 16384, torch.float32)            # 1 GiB: chunks of 1024 queries
        1024
    """
    cfg = attn.config
    itemsize = dtype.itemsize
    q_bytes = b * s_q * cfg.inner_dim * itemsize
    unchunked = 2 * q_bytes + 2 * b * s_kv * cfg.kv_dim * itemsize  # Q and context; K and V
    if unchunked <= CHUNK_ABOVE_BYTES:
        return None
    per_position = max(1, b * cfg.inner_dim * itemsize)
    c = max(_ALIGN, CHUNK_BYTES // per_position // _ALIGN * _ALIGN)
    return c if c < s_q else None


def forward_in_chunks(
    attn: "MultiHeadAttention", x: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, *,
    mask: torch.Tensor | None, causal: bool, positions: torch.Tensor | None, chunk: int,
) -> torch.Tensor:
    """The layer's forward, ``chunk`` query positions at a time (inputs already validated and batched).

    Call it under ``torch.no_grad()``: it writes into buffers it owns (the output, the rotated keys).

    Shapes:
        x: (b, s_q, d); key: (b, s_kv, kdim) or None (self-attention); value: (b, s_kv, vdim) or None
        mask: broadcastable to (b, h, s_q, s_kv); positions: (s_q,) or (b, s_q), rotary only
        -> (b, s_q, d)
    """
    b, s_q, _ = x.shape
    k, v = attn.project_kv(key, value) if key is not None else attn.project_kv(x)  # (b, h_kv, s_kv, d_h)
    s_kv = k.shape[2]
    cos = sin = None
    if attn.rotary is not None:  # self-attention only (checked by the layer), so s_kv == s_q
        if positions is None:
            positions = torch.arange(s_q, device=x.device)
        cos, sin = attn.rotary(positions, x.dtype)  # (b or 1, 1, s_q, r)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        # k is a view of k_proj's fresh output: rotate it in place a chunk at a time, so the rotation's
        # output is chunk-sized instead of a second s_kv x kv_dim tensor.
        for i0 in range(0, s_kv, chunk):
            i1 = min(i0 + chunk, s_kv)
            k[:, :, i0:i1] = apply_rotary(k[:, :, i0:i1], cos[:, :, i0:i1], sin[:, :, i0:i1])
    if mask is not None and mask.dim() < 2:
        mask = mask.view((1,) * (2 - mask.dim()) + tuple(mask.shape))  # give it an s_q axis to slice
    y = x.new_empty(b, s_q, attn.config.d_model)
    scale = attn.config.scale
    for i0 in range(0, s_q, chunk):
        i1 = min(i0 + chunk, s_q)
        q = attn.project_q(x[:, i0:i1])  # (b, h, c, d_h)
        if cos is not None:
            q = apply_rotary(q, cos[:, :, i0:i1], sin[:, :, i0:i1])
        # Bottom-right causal: query i reads keys j <= i + s_kv - s_q, so this chunk needs keys up to `end`.
        end = max(0, min(s_kv, i1 + s_kv - s_q)) if causal else s_kv
        if causal and mask is None and end >= i1 - i0 and lse_merge_available(q.device, q.dtype):
            ctx = _causal_chunk_by_lse(q, k, v, end - (i1 - i0), end, scale)  # (b, h, c, d_h)
        else:
            chunk_mask = None
            if mask is not None:
                rows = mask if mask.shape[-2] == 1 else mask[..., i0:i1, :]
                chunk_mask = rows if mask.shape[-1] == 1 else rows[..., :end]
            ctx, _ = hwf.attention(q, k[:, :, :end], v[:, :, :end], mask=chunk_mask, scale=scale,
                                   causal=causal)  # (b, h, c, d_h); chunking is only chosen without dropout
        del q
        y[:, i0:i1] = attn.project_out(ctx)  # (b, c, d)
    return y


def _cpu_flash_op():  # looked up per call so tests can remove it
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def lse_merge_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether causal chunks can run as two flash calls merged by log-sum-exp here (CPU, float32/float64,
    and PyTorch exposes its CPU flash op); elsewhere they use an explicit bottom-right mask.

    Shapes:
        no tensors: a rule on the device and dtype only.

    Example:
        >>> lse_merge_available(torch.device("cpu"), torch.float32), lse_merge_available(torch.device("cpu"), torch.bfloat16)
        (True, False)
    """
    return device.type == "cpu" and dtype in (torch.float32, torch.float64) and _cpu_flash_op() is not None


def _causal_chunk_by_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, end: int,
                         scale: float) -> torch.Tensor:
    """One causal chunk: every query reads keys ``[0, start)`` in full and the square block ``[start, end)``
    causally; the two softmaxes are merged through their log-sum-exps ``l``:
    ``out = sum_part exp(l_part - l) * out_part`` with ``l = logaddexp(l_a, l_b)``.

    Shapes:
        q: (b, h, c, d_h) with c = end - start; k, v: (b, h_kv, s_kv, d_h) -> (b, h, c, d_h)
    """
    op = _cpu_flash_op()
    out_b, lse_b = op(q, k[:, :, start:end], v[:, :, start:end], 0.0, True, scale=scale)  # (b, h, c, d_h), (b, h, c)
    if start == 0:
        return out_b
    out_a, lse_a = op(q, k[:, :, :start], v[:, :, :start], 0.0, False, scale=scale)
    lse = torch.logaddexp(lse_a, lse_b)  # (b, h, c)
    out_a = out_a.mul_(torch.exp(lse_a - lse).unsqueeze(-1))
    return out_a.add_(out_b.mul_(torch.exp(lse_b - lse).unsqueeze(-1)))  # (b, h, c, d_h)
