"""The statistics kernel (Triton): a flash-attention forward that also keeps what the statistics need.

Pass 1 (:func:`_stats_forward`), one program per block of query rows of one head, walks the key blocks the
rows may read with the usual online softmax (running maximum ``m``, normaliser ``l``, context accumulator) and
one more running sum, ``a = sum_j exp(s_j - m) (s_j - m)``, rescaled like ``l`` when ``m`` grows:
``a <- exp(m_old - m_new) (a + (m_old - m_new) l)``. At the end ``lse = m + log l``,
``entropy = (l log l - a) / l`` and ``max_weight = exp(m - lse)``: the output and three statistics from one
read of Q, K and V. Pass 2 (:func:`_stats_key_weight`), only for ``key_weight``, runs one program per block
of keys of one head over the query blocks that may read it (like flash attention's dK loop), recomputes the
scores and adds ``exp(s - lse)`` down the rows.

Masks (bool, or floating and added to the scores) are read through their strides, broadcast dimensions at
stride 0; causal masking is bottom-right (query i reads keys j <= i + s_kv - s_q), and causal programs skip
the key blocks none of their rows may read. Softcap, sinks (per head or per row) and GQA (query head i reads
K/V head i // g) are applied inside. Scores and statistics are float32 whatever the inputs' dtype.

Only long-stable Triton is used (``tl.load``/``store``/``dot``/``exp``/``log``/``max``/``sum``/``where``).
With ``TRITON_INTERPRET=1`` set before Triton is imported, Triton's interpreter runs the kernels on CPU tensors
(the tests compare them with float64 there, in a process started with it).

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d_h: query/key head width, d_v: value head width.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # plan rule 10 never picks the kernel without triton; the module still imports (doctests)
    triton = tl = None

__all__ = ["kernel_statistics", "INTERPRETED", "blocks"]


def _jit(fn):  # type: ignore[no-untyped-def]
    return fn if triton is None else triton.jit(fn)


#: Whether the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@_jit
def _scores(q, kt, offs_m, offs_n, mask_ptr, smm, smn, S_Q, S_KV, OFF, scale, softcap,
            CHECKS: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
            SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of scores in float32, -inf where a row may not read a key (with ``CHECKS``:
    key bounds and causality; the mask always), and where each may be read."""
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = s * scale
    if SOFTCAP:
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # softcap * tanh(s / softcap)
    valid = (offs_n < S_KV)[None, :] & (offs_m >= 0)[:, None]
    if CHECKS:
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + OFF)
    if HAS_MASK:
        inside = (offs_m < S_Q)[:, None] & (offs_n < S_KV)[None, :]
        rows = offs_m.to(tl.int64)  # a (s, s) mask passes 2**31 elements at s 46341
        mt = tl.load(mask_ptr + rows[:, None] * smm + offs_n[None, :] * smn, mask=inside, other=0)
        if MASK_BOOL:
            valid = valid & (mt != 0)
        else:
            mt = mt.to(tl.float32)
            s = s + mt
            valid = valid & (mt > float("-inf"))
    s = tl.where(valid, s, float("-inf"))
    return s, valid


@_jit
def _forward_tile(acc, l_i, m_i, a_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, offs_dv, mask_ptr, smm, smn, S_Q,
                  S_KV, OFF, scale, softcap, D: tl.constexpr, DV: tl.constexpr, CHECKS: tl.constexpr,
                  CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, SOFTCAP: tl.constexpr,
                  IEEE: tl.constexpr):
    """The online-softmax update of one key tile, with the entropy's running sum."""
    kt = tl.load(k_ptrs, mask=(offs_d < D)[:, None] & (offs_n < S_KV)[None, :], other=0.0)  # (BLOCK_D, BLOCK_N)
    s, valid = _scores(q, kt, offs_m, offs_n, mask_ptr, smm, smn, S_Q, S_KV, OFF, scale, softcap,
                       CHECKS, CAUSAL, HAS_MASK, MASK_BOOL, SOFTCAP, IEEE)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has read nothing yet: any finite reference
    alpha = tl.exp(m_i - ref)
    shifted = tl.where(valid, s - ref[:, None], 0.0)
    p = tl.where(valid, tl.exp(shifted), 0.0)
    delta = tl.where(m_i == float("-inf"), 0.0, m_i - ref)
    a_i = alpha * (a_i + delta * l_i) + tl.sum(p * shifted, 1)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=(offs_n < S_KV)[:, None] & (offs_dv < DV)[None, :], other=0.0)  # (BLOCK_N, BLOCK_DV)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new, a_i


@_jit
def _stats_forward(
    Q, K, V, Z, LSE, ENT, MAXW, MASK, SINK,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, szb, szh, szm, szd,
    smb, smh, smm, smn, ssb, ssh, ssm,
    H, G, S_Q, S_KV, scale, softcap, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINK: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    bi = pid_bh // H
    hq = pid_bh % H
    hk = hq // G
    OFF = S_KV - S_Q
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + bi * sqb + hq * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=(offs_m < S_Q)[:, None] & (offs_d < D)[None, :], other=0.0)
    k_base = K + bi * skb + hk * skh + offs_d[:, None] * skd  # K^T tiles: (BLOCK_D, BLOCK_N)
    v_base = V + bi * svb + hk * svh + offs_dv[None, :] * svd  # V tiles: (BLOCK_N, BLOCK_DV)
    mask_ptr = MASK + bi * smb + hq * smh
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    a_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    hi = S_KV
    full = S_KV // BLOCK_N * BLOCK_N  # key tiles every row reads in full, without bounds or causal checks
    if CAUSAL:
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + OFF, 0), S_KV)
        full = tl.minimum(tl.maximum(start_m + OFF + 1, 0), S_KV) // BLOCK_N * BLOCK_N
    for start_n in range(0, full, BLOCK_N):
        cols = start_n + offs_n
        acc, l_i, m_i, a_i = _forward_tile(
            acc, l_i, m_i, a_i, q, k_base + cols[None, :] * skn, v_base + cols[:, None] * svn, offs_m, cols,
            offs_d, offs_dv, mask_ptr, smm, smn, S_Q, S_KV, OFF, scale, softcap, D, DV, False, CAUSAL, HAS_MASK,
            MASK_BOOL, SOFTCAP, IEEE)
    for start_n in range(full, hi, BLOCK_N):
        cols = start_n + offs_n
        acc, l_i, m_i, a_i = _forward_tile(
            acc, l_i, m_i, a_i, q, k_base + cols[None, :] * skn, v_base + cols[:, None] * svn, offs_m, cols,
            offs_d, offs_dv, mask_ptr, smm, smn, S_Q, S_KV, OFF, scale, softcap, D, DV, True, CAUSAL, HAS_MASK,
            MASK_BOOL, SOFTCAP, IEEE)
    l_keys = l_i
    top = m_i
    if HAS_SINK:
        sk = tl.load(SINK + bi * ssb + hq * ssh + offs_m * ssm, mask=offs_m < S_Q, other=0.0).to(tl.float32)
        ref = tl.maximum(m_i, sk)
        keep = tl.exp(m_i - ref)
        delta = tl.where(m_i == float("-inf"), 0.0, m_i - ref)
        a_i = keep * (a_i + delta * l_i)
        l_keys = l_i * keep
        acc = acc * keep[:, None]
        total = l_keys + tl.exp(sk - ref)
    else:
        ref = tl.where(m_i == float("-inf"), 0.0, m_i)
        total = l_i
    dead = m_i == float("-inf")  # no readable key (a far larger sink may underflow l_keys to zero)
    total = tl.where(dead, 1.0, total)
    log_total = tl.log(total)
    lse = tl.where(dead, float("-inf"), ref + log_total)
    ent = tl.where(dead, 0.0, tl.maximum((l_keys * log_total - a_i) / total, 0.0))
    maxw = tl.where(dead, 0.0, tl.exp(top - ref - log_total))
    z = tl.where(dead[:, None], 0.0, acc / total[:, None])
    row = pid_bh * S_Q + offs_m
    inside = offs_m < S_Q
    tl.store(LSE + row, lse, mask=inside)
    tl.store(ENT + row, ent, mask=inside)
    tl.store(MAXW + row, maxw, mask=inside)
    tl.store(Z + bi * szb + hq * szh + offs_m[:, None] * szm + offs_dv[None, :] * szd, z.to(Z.dtype.element_ty),
             mask=inside[:, None] & (offs_dv < DV)[None, :])


@_jit
def _stats_key_weight(
    Q, K, LSE, KW, MASK,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, smb, smh, smm, smn,
    H, G, S_Q, S_KV, scale, softcap, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    bi = pid_bh // H
    hq = pid_bh % H
    hk = hq // G
    OFF = S_KV - S_Q
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kt = tl.load(K + bi * skb + hk * skh + offs_d[:, None] * skd + offs_n[None, :] * skn,
                 mask=(offs_d < D)[:, None] & (offs_n < S_KV)[None, :], other=0.0)  # (BLOCK_D, BLOCK_N), read once
    mask_ptr = MASK + bi * smb + hq * smh
    kw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    lo = 0
    if CAUSAL:  # query i reads key j iff j <= i + OFF: the first query block that may read this key block
        lo = tl.maximum(start_n - OFF, 0) // BLOCK_M * BLOCK_M
    for start_m in range(lo, S_Q, BLOCK_M):
        offs_m = start_m + offs_m0
        rows = offs_m < S_Q
        q = tl.load(Q + bi * sqb + hq * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                    mask=rows[:, None] & (offs_d < D)[None, :], other=0.0)
        lse = tl.load(LSE + pid_bh * S_Q + offs_m, mask=rows, other=float("-inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)  # a row that reads nothing adds nothing
        s, valid = _scores(q, kt, offs_m, offs_n, mask_ptr, smm, smn, S_Q, S_KV, OFF, scale, softcap,
                           True, CAUSAL, HAS_MASK, MASK_BOOL, SOFTCAP, IEEE)
        p = tl.where(valid & rows[:, None], tl.exp(s - lse[:, None]), 0.0)
        kw += tl.sum(p, 0)
    tl.store(KW + pid_bh * S_KV + offs_n, kw, mask=offs_n < S_KV)


def blocks(d_h: int, d_v: int, dtype: torch.dtype) -> dict:
    """Tile sizes and launch settings for one head width and dtype: 128 x 64 tiles for half precision up to
    d_h 128, smaller where the tiles would not fit a streaming multiprocessor's shared memory, 16 x 16 under
    the interpreter (its cost grows with the tile, not with the work)."""
    bd, bdv = max(16, triton.next_power_of_2(d_h)), max(16, triton.next_power_of_2(d_v))
    if INTERPRETED:
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_D=bd, BLOCK_DV=bdv, num_warps=4, num_stages=1)
    wide = max(bd, bdv)
    if dtype == torch.float32:
        bm, bn = (64, 32) if wide <= 128 else (32, 32)
    else:
        bm, bn = (128, 64) if wide <= 128 else (64, 32)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, BLOCK_DV=bdv, num_warps=8 if wide >= 128 else 4,
                num_stages=2 if wide > 128 else 3)


def kernel_statistics(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None,
    causal: bool = False, softcap: float | None = None, sinks: torch.Tensor | None = None,
    names: tuple[str, ...] = ("lse", "entropy", "max_weight", "key_weight"),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The context and the statistics ``names``, from the two kernels (the same arguments as
    :func:`headwise.statistics.chunks.chunked_statistics`).

    Shapes:
        q: (b, h, s_q, d_h); k: (b, h_kv, s_kv, d_h); v: (b, h_kv, s_kv, d_v); mask: 4-D, broadcastable to
        (b, h, s_q, s_kv); sinks: (h,) or (b or 1, h, s_q or 1, 1)
        -> z (b, h, s_q, d_v) in q's dtype; lse, entropy, max_weight (b, h, s_q), key_weight (b, h, s_kv), float32
    """
    if triton is None:
        raise ImportError("the statistics kernel needs triton (pip install triton)")
    b, h, s_q, d_h = q.shape
    h_kv, s_kv, d_v = k.shape[1], k.shape[2], v.shape[-1]
    dev = q.device
    if b * h > 65535:  # the grid's second axis
        raise ValueError(f"the statistics kernel runs at most 65535 (batch row, head) pairs, got b*h = {b * h}")
    cfg = blocks(d_h, d_v, q.dtype)
    launch = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
    bdv = cfg.pop("BLOCK_DV")
    z = torch.empty(b, h, s_q, d_v, dtype=q.dtype, device=dev)
    lse, ent, maxw = (torch.empty(b, h, s_q, dtype=torch.float32, device=dev) for _ in range(3))
    if mask is None:
        m, mstrides, mask_bool = lse, (0, 0, 0, 0), True  # never read
    else:
        m = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        m = m.expand(b, h, s_q, s_kv)  # broadcast dimensions at stride 0: nothing is copied
        mstrides, mask_bool = m.stride(), mask.dtype == torch.bool
    if sinks is None:
        sink, sstrides = lse, (0, 0, 0)
    else:
        sink = (sinks.view(1, h, 1, 1) if sinks.dim() == 1 else sinks).expand(b, h, s_q, 1)
        sstrides = sink.stride()[:3]
    flags = dict(CAUSAL=bool(causal), HAS_MASK=mask is not None, MASK_BOOL=mask_bool, SOFTCAP=softcap is not None,
                 IEEE=q.dtype == torch.float32)
    cap = float(softcap) if softcap is not None else 1.0
    out = {}
    grid = (triton.cdiv(s_q, cfg["BLOCK_M"]), b * h)
    _stats_forward[grid](
        q, k, v, z, lse, ent, maxw, m, sink, *q.stride(), *k.stride(), *v.stride(), *z.stride(), *mstrides,
        *sstrides, h, h // h_kv, s_q, s_kv, float(scale), cap, D=d_h, DV=d_v, BLOCK_DV=bdv,
        HAS_SINK=sinks is not None, **cfg, **flags, **launch)
    out.update(lse=lse, entropy=ent, max_weight=maxw)
    if "key_weight" in names:
        kw = torch.empty(b, h, s_kv, dtype=torch.float32, device=dev)
        grid = (triton.cdiv(s_kv, cfg["BLOCK_N"]), b * h)
        _stats_key_weight[grid](q, k, lse, kw, m, *q.stride(), *k.stride(), *mstrides, h, h // h_kv, s_q, s_kv,
                                float(scale), cap, D=d_h, **cfg, **flags, **launch)
        out["key_weight"] = kw
    return z, {n: out[n] for n in names}
