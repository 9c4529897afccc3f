"""Memory of attention: the KV cache and the attention probabilities.

KV cache: every layer keeps, per token, one key and one value vector per K/V head:
``2 * h_kv * d_h * itemsize`` bytes per token per layer (GQA/MQA shrink it by ``h / h_kv``), times the
batch, the context length and the number of layers.

Attention probabilities: the eager path materialises ``softmax(Q K^T)`` for every head,
``b * h * s_q * s_kv * itemsize`` bytes per layer, with 4-byte entries for float16/bfloat16 (it computes them in
float32, as PyTorch's math kernel does). It also holds the scores while the softmax runs, and in training keeps
the probabilities of every layer for the backward pass. The fused path
(``scaled_dot_product_attention`` with a flash / memory-efficient kernel) never stores the ``s_q x s_kv``
matrix: it streams K/V blocks and keeps, besides the output ``(b, h, s_q, d_h)`` that both paths produce,
one log-sum-exp per query row and head for the backward pass: ``b * h * s_q * 4`` bytes (float32) for float32
and narrower inputs, ``b * h * s_q * 8`` (float64) for float64 ones (:func:`lse_itemsize`).

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads, d_h: d_head.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..config import AttentionConfig
from .flops import check_positive
from .params import check_config

if TYPE_CHECKING:  # the calculators themselves never import torch: they are plain integer arithmetic
    import torch

__all__ = ["AttentionMemory", "attention_memory", "kv_cache_bytes", "kv_cache_bytes_per_token", "dtype_itemsize",
           "dtype_info", "probability_itemsize", "lse_itemsize", "parse_dtype", "DTYPES", "DTYPE_NAMES"]

# Names accepted for dtypes (the CLI's --dtype): name -> (torch's name for it, bytes per element).
DTYPE_NAMES: dict[str, tuple[str, int]] = {
    "float32": ("float32", 4), "fp32": ("float32", 4), "float": ("float32", 4),
    "float16": ("float16", 2), "fp16": ("float16", 2), "half": ("float16", 2),
    "bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2),
    "float64": ("float64", 8), "fp64": ("float64", 8), "double": ("float64", 8),
    "float8_e4m3fn": ("float8_e4m3fn", 1), "fp8": ("float8_e4m3fn", 1),
}

# The fused kernels keep their per-row log-sum-exp in float32 at least: wider inputs keep it in their own dtype.
_LSE_MIN_BYTES = 4
# Half-precision inputs get float32 probabilities on the eager path (headwise.plan rule 2).
_UPCAST = ("float16", "bfloat16")


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # name -> torch.dtype; built on first use, as it needs torch
        import torch

        return {k: getattr(torch, v) for k, (v, _) in DTYPE_NAMES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_info(dtype: "torch.dtype | str") -> tuple[str, int]:
    """(torch's name, bytes per element) of a torch dtype or one of the names in :data:`DTYPE_NAMES`,
    without importing torch for a name.

    Shapes:
        none (a dtype in, a name and an int out)

    Example:
        >>> dtype_info("bf16"), dtype_info("FP32")
        (('bfloat16', 2), ('float32', 4))
    """
    if isinstance(dtype, str) and dtype.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower()]
    torch = sys.modules.get("torch")  # a torch.dtype can only exist once torch is imported
    if torch is not None and isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch."), dtype.itemsize
    raise ValueError(f"dtype must be a torch.dtype or one of {sorted(DTYPE_NAMES)}, got {dtype!r}")


def parse_dtype(dtype: "torch.dtype | str") -> "torch.dtype":
    """A torch dtype from a dtype or one of the names in :data:`DTYPE_NAMES`.

    Shapes:
        none (a dtype in, a dtype out)

    Example:
        >>> import torch
        >>> parse_dtype("bf16"), parse_dtype(torch.float16)
        (torch.bfloat16, torch.float16)
    """
    name, _ = dtype_info(dtype)
    import torch

    return getattr(torch, name)


def dtype_itemsize(dtype: "torch.dtype | str") -> int:
    """Bytes per element of ``dtype`` (a torch dtype or a name in :data:`DTYPE_NAMES`).

    Shapes:
        none (a dtype in, an int out)

    Example:
        >>> import torch
        >>> dtype_itemsize("float32"), dtype_itemsize(torch.bfloat16)
        (4, 2)
    """
    return dtype_info(dtype)[1]


def kv_cache_bytes_per_token(config: AttentionConfig, *, dtype: "torch.dtype | str" = "float16",
                             n_layers: int = 1) -> int:
    """Bytes one token adds to the KV cache: ``2 * h_kv * d_h * itemsize * n_layers``.

    Shapes:
        per layer: keys and values (h_kv, d_h) each

    Example:
        >>> from headwise import AttentionConfig
        >>> kv_cache_bytes_per_token(AttentionConfig(d_model=4096, n_heads=32, n_kv_heads=8), n_layers=32)
        131072
    """
    check_config(config)
    n_layers = check_positive("n_layers", n_layers)
    return 2 * config.n_kv_heads * config.d_head * dtype_itemsize(dtype) * n_layers


def kv_cache_bytes(config: AttentionConfig, seq_len: int, *, batch: int = 1, dtype: "torch.dtype | str" = "float16",
                   n_layers: int = 1) -> int:
    """Bytes of a KV cache holding ``seq_len`` tokens for ``batch`` sequences; equals the ``nbytes`` of
    ``MultiHeadAttention.new_cache(batch, seq_len)`` per layer.

    Shapes:
        per layer: keys, values (b, h_kv, s, d_h)

    Example:
        >>> from headwise import AttentionConfig
        >>> kv_cache_bytes(AttentionConfig(d_model=32, n_heads=4), 16, batch=2, dtype="float32")
        8192
    """
    seq_len = check_positive("seq_len", seq_len)
    batch = check_positive("batch", batch)
    return kv_cache_bytes_per_token(config, dtype=dtype, n_layers=n_layers) * seq_len * batch


@dataclass(frozen=True)
class AttentionMemory:
    """Bytes the attention step holds beyond Q, K, V and the output, per layer and for ``n_layers``.

    Shapes:
        materialised: probabilities (b, h, s_q, s_kv); fused: log-sum-exp (b, h, s_q), float32 (float64 inputs:
        float64)
    """

    materialised: int  # eager: the probabilities (b, h, s_q, s_kv)
    fused: int  # flash-style kernel: one log-sum-exp per (b, h, query), lse_itemsize bytes each
    n_layers: int

    @property
    def materialised_all_layers(self) -> int:
        """What training keeps for the backward pass of ``n_layers`` eager layers."""
        return self.materialised * self.n_layers

    @property
    def fused_all_layers(self) -> int:
        return self.fused * self.n_layers

    @property
    def ratio(self) -> float:
        """How many times more the eager path holds (``s_kv * probability_itemsize / lse_itemsize``)."""
        return self.materialised / self.fused

    def to_dict(self) -> dict[str, float]:
        return asdict(self) | {"materialised_all_layers": self.materialised_all_layers,
                               "fused_all_layers": self.fused_all_layers, "ratio": self.ratio}


def probability_itemsize(dtype: "torch.dtype | str") -> int:
    """Bytes per attention probability on headwise's eager path for ``dtype`` (a name such as ``"bf16"`` or a
    ``torch.dtype``): float32's 4 for float16/bfloat16, which it computes in float32, else the dtype's own.

    Example:
        >>> probability_itemsize("bf16"), probability_itemsize("float64")
        (4, 8)
    """
    name, itemsize = dtype_info(dtype)
    return 4 if name in _UPCAST else itemsize


def lse_itemsize(dtype: "torch.dtype | str") -> int:
    """Bytes per log-sum-exp the fused path keeps for the backward pass, for inputs of ``dtype``: float32's 4
    for float32 and narrower dtypes, float64's 8 for float64 (the dtype of the statistic the kernel saves).

    Example:
        >>> lse_itemsize("bf16"), lse_itemsize("float32"), lse_itemsize("float64")
        (4, 4, 8)
    """
    return max(_LSE_MIN_BYTES, dtype_info(dtype)[1])


def attention_memory(config: AttentionConfig, seq_len: int, *, batch: int = 1, kv_len: int | None = None,
                     dtype: "torch.dtype | str" = "float32", n_layers: int = 1) -> AttentionMemory:
    """Memory of the attention probabilities on the eager path versus the fused path (module doc).

    Shapes:
        materialised: b * h * s_q * s_kv * itemsize (4 for float16/bfloat16); fused: b * h * s_q * lse_itemsize
        (4, or 8 for float64)

    Example:
        >>> from headwise import AttentionConfig
        >>> m = attention_memory(AttentionConfig(d_model=4096, n_heads=32), 4096, dtype="float16")
        >>> m.materialised == 32 * 4096 ** 2 * 4, m.fused == 32 * 4096 * 4
        (True, True)
    """
    check_config(config)
    s_q = check_positive("seq_len", seq_len)
    b = check_positive("batch", batch)
    s_kv = s_q if kv_len is None else check_positive("kv_len", kv_len)
    n_layers = check_positive("n_layers", n_layers)
    rows = b * config.n_heads * s_q
    return AttentionMemory(materialised=rows * s_kv * probability_itemsize(dtype), fused=rows * lse_itemsize(dtype),
                           n_layers=n_layers)
