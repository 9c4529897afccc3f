"""Pure calculators for what an attention layer costs: parameters, FLOPs, KV-cache and attention memory.

Every function takes an :class:`~headwise.AttentionConfig` plus sizes (sequence length, batch, dtype)
and returns plain numbers (exact Python ints from closed forms: no loop over the sequence, no overflow);
nothing is allocated and torch is not imported (give dtypes by name, e.g. ``"bf16"``). The figures are
checked in ``tests/analysis`` against real modules (``sum(p.numel())``, ``KVCache.nbytes``) and PyTorch's
``FlopCounterMode``.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: d_model, d_h: d_head.

Example:
    >>> from headwise import AttentionConfig
    >>> from headwise.analysis import param_count
    >>> param_count(AttentionConfig(d_model=4096, n_heads=32, bias=False)).total == 4 * 4096 ** 2
    True
"""

from __future__ import annotations

from .flops import FlopCount, forward_flops
from .memory import (AttentionMemory, attention_memory, dtype_info, dtype_itemsize, kv_cache_bytes,
                     kv_cache_bytes_per_token, parse_dtype)
from .params import ParamCount, param_count
from .summary import summarize

__all__ = [
    "ParamCount", "param_count",
    "FlopCount", "forward_flops",
    "AttentionMemory", "attention_memory", "kv_cache_bytes", "kv_cache_bytes_per_token",
    "dtype_info", "dtype_itemsize", "parse_dtype",
    "summarize",
]
