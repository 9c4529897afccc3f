"""Floating-point operations of one attention forward.

Convention: **FLOPs = 2 x multiply-adds of the matrix products** (one multiply and one add each), the
convention of ``torch.utils.flop_counter.FlopCounterMode`` and of most papers. Bias additions, the
``* scale``, the mask and the softmax are element-wise, ``O(b * h * s_q * s_kv)`` at most, and are *not*
counted (they are below 1 % of the total for ``d_h >= 64``).

The attention part is the two products per head, ``Q K^T`` (scores) and ``P V`` (context). Under a
causal mask the masked half is still computed by the standard kernels (eager and SDPA math compute the
full ``s_q x s_kv`` product, then mask), so it *is* counted unless ``causal_skip=True``, which counts
only the unmasked (query, key) pairs, what a kernel that skips masked blocks ideally does.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: d_model, d_h: d_head.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import AttentionConfig
from .params import check_config

__all__ = ["FlopCount", "forward_flops", "causal_pairs", "check_positive"]


@dataclass(frozen=True)
class FlopCount:
    """FLOPs (2 x multiply-adds) of each matrix product of one layer's forward.

    Shapes:
        projections: x (b, s, d) @ W (d, out); scores: (b, h, s_q, d_h) @ (b, h, d_h, s_kv);
        context: (b, h, s_q, s_kv) @ (b, h, s_kv, d_h)
    """

    q_proj: int
    k_proj: int
    v_proj: int
    out_proj: int
    scores: int  # Q K^T, every head
    context: int  # P V, every head

    @property
    def projections(self) -> int:
        return self.q_proj + self.k_proj + self.v_proj + self.out_proj

    @property
    def attention(self) -> int:
        return self.scores + self.context

    @property
    def total(self) -> int:
        return self.projections + self.attention

    def to_dict(self) -> dict[str, int]:
        return asdict(self) | {"projections": self.projections, "attention": self.attention, "total": self.total}


def check_positive(name: str, value: object) -> int:
    """``value`` if it is a positive int (any size), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def causal_pairs(s_q: int, s_kv: int) -> int:
    """Number of (query, key) pairs a bottom-right aligned causal mask keeps (query i sits at s_kv - s_q + i).

    Shapes:
        the count of True entries of ``causal_mask(s_q, s_kv)``, (s_q, s_kv)

    Example:
        >>> causal_pairs(4, 4), causal_pairs(1, 10), causal_pairs(3, 2)
        (10, 10, 3)
        >>> causal_pairs(10 ** 30, 10 ** 30) == 10 ** 30 * (10 ** 30 + 1) // 2   # a closed form: no loop over s_q
        True
    """
    s_q, s_kv = check_positive("s_q", s_q), check_positive("s_kv", s_kv)
    # Query i sees keys 0 .. offset + i with offset = s_kv - s_q; the last query sees all s_kv keys, so the
    # count is 1 + 2 + ... + s_kv minus the 1 + ... + offset keys that no query before the first one has.
    offset = max(0, s_kv - s_q)
    return (s_kv * (s_kv + 1) - offset * (offset + 1)) // 2


def forward_flops(config: AttentionConfig, seq_len: int, *, batch: int = 1, kv_len: int | None = None,
                  causal_skip: bool = False) -> FlopCount:
    """FLOPs of one forward of ``MultiHeadAttention.from_config(config)`` (see the module doc for the
    convention): ``seq_len`` query tokens attending to ``kv_len`` key/value tokens (default: self-attention,
    ``kv_len = seq_len``). With ``kv_len`` the K/V projections run on ``kv_len`` tokens of width kdim/vdim.

    Every query head does its own ``Q K^T`` and ``P V`` even under GQA (K/V heads are shared, not the work),
    so the attention part depends on ``h``, not ``h_kv``.

    Shapes:
        q_proj: 2 b s_q d (h d_h); k_proj: 2 b s_kv kdim (h_kv d_h); v_proj: 2 b s_kv vdim (h_kv d_h);
        out_proj: 2 b s_q (h d_h) d; scores = context: 2 b h s_q s_kv d_h

    Example:
        >>> from headwise import AttentionConfig
        >>> f = forward_flops(AttentionConfig(d_model=4096, n_heads=32), seq_len=4096)
        >>> f.projections == 2 * 4096 * 4 * 4096 ** 2, f.attention == 4 * 4096 ** 2 * 4096
        (True, True)
    """
    check_config(config)
    s_q = check_positive("seq_len", seq_len)
    b = check_positive("batch", batch)
    s_kv = s_q if kv_len is None else check_positive("kv_len", kv_len)
    c = config
    pairs = causal_pairs(s_q, s_kv) if causal_skip else s_q * s_kv
    per_product = 2 * b * c.n_heads * pairs * c.d_head
    return FlopCount(
        q_proj=2 * b * s_q * c.d_model * c.inner_dim,
        k_proj=2 * b * s_kv * c.kdim * c.kv_dim,
        v_proj=2 * b * s_kv * c.vdim * c.kv_dim,
        out_proj=2 * b * s_q * c.inner_dim * c.d_model,
        scores=per_product,
        context=per_product,
    )
