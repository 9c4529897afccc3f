"""Parameter counts of one attention layer, per projection.

Shapes:
    d: d_model, h: n_heads, h_kv: n_kv_heads, d_h: d_head.
    W_Q: (d, h * d_h); W_K: (kdim, h_kv * d_h); W_V: (vdim, h_kv * d_h); W_O: (h * d_h, d).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import AttentionConfig

__all__ = ["ParamCount", "param_count", "check_config"]


@dataclass(frozen=True)
class ParamCount:
    """Parameters of each projection (weights plus biases) of one layer.

    Shapes:
        q: W_Q (d, h * d_h) [+ b_Q]; k, v: (kdim | vdim, h_kv * d_h) [+ bias]; out: W_O (h * d_h, d) [+ b_O]
    """

    q: int
    k: int
    v: int
    out: int

    @property
    def total(self) -> int:
        return self.q + self.k + self.v + self.out

    def to_dict(self) -> dict[str, int]:
        return asdict(self) | {"total": self.total}


def check_config(config: AttentionConfig) -> None:
    if not isinstance(config, AttentionConfig):
        raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")


def param_count(config: AttentionConfig, *, bias: bool | None = None) -> ParamCount:
    """Parameters of ``MultiHeadAttention.from_config(config)``, projection by projection.

    ``bias=None`` follows the config (``bias`` for Q/K/V, ``out_bias`` for W_O); ``True``/``False``
    forces biases on or off everywhere. GQA/MQA shrink W_K and W_V to ``h_kv * d_h`` output features.

    Shapes:
        q: d * h * d_h (+ h * d_h); k: kdim * h_kv * d_h (+ h_kv * d_h); v: vdim * h_kv * d_h (+ h_kv * d_h);
        out: h * d_h * d (+ d)

    Example:
        >>> from headwise import AttentionConfig
        >>> p = param_count(AttentionConfig(d_model=768, n_heads=12))   # GPT-2 small's attention
        >>> p.total, p.total - param_count(AttentionConfig(d_model=768, n_heads=12), bias=False).total
        (2362368, 3072)
        >>> param_count(AttentionConfig(d_model=4096, n_heads=32, n_kv_heads=8, bias=False)).k
        4194304
    """
    check_config(config)
    if bias is not None and not isinstance(bias, bool):
        raise TypeError(f"bias must be a bool or None, got {bias!r}")
    in_bias = config.bias if bias is None else bias
    out_bias = config.out_bias if bias is None else bias
    c = config
    return ParamCount(
        q=c.d_model * c.inner_dim + (c.inner_dim if in_bias else 0),
        k=c.kdim * c.kv_dim + (c.kv_dim if in_bias else 0),
        v=c.vdim * c.kv_dim + (c.kv_dim if in_bias else 0),
        out=c.inner_dim * c.d_model + (c.d_model if out_bias else 0),
    )
