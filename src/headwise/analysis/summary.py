"""Every figure of :mod:`headwise.analysis` for one configuration, as one dictionary (what the CLI shows).

Shapes:
    b: batch, s: sequence length, h: query heads, h_kv: key/value heads, d: d_model, d_h: d_head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config import AttentionConfig
from .flops import check_positive, forward_flops
from .memory import attention_memory, kv_cache_bytes, kv_cache_bytes_per_token, dtype_info
from .params import param_count

if TYPE_CHECKING:
    import torch

__all__ = ["summarize"]


def summarize(config: AttentionConfig, seq_len: int, *, batch: int = 1, dtype: "torch.dtype | str" = "float16",
              n_layers: int = 1, sliding_window: int | None = None) -> dict[str, Any]:
    """Parameters, FLOPs, KV cache and probability memory of one layer and of ``n_layers`` layers.

    Args:
        config: one layer.
        seq_len: tokens of the sequence.
        batch: sequences.
        dtype: the storage dtype of the figures.
        n_layers: layers the model stacks.
        sliding_window: every layer attends to at most this many positions (Mistral's ``sliding_window``):
            its cache holds only the last ``min(seq_len, sliding_window)`` positions (``kv_cache["positions"]``),
            the keys a step reads (transformers' sliding-window cache keeps ``sliding_window - 1`` between steps
            and adds the new token's). None: every position is kept.

    Shapes:
        x: (b, s, d); KV cache (b, h_kv, min(s, window), d_h) x 2 per layer; probabilities (b, h, s, s) per layer

    Example:
        >>> from headwise import AttentionConfig
        >>> s = summarize(AttentionConfig(d_model=4096, n_heads=32, n_kv_heads=8), 1024, n_layers=32)
        >>> s["kv_cache"]["per_1k_tokens_bytes"] == 1000 * 131072, s["params"]["layer"]["k"] == 4096 * 1024 + 1024
        (True, True)
    """
    dt, _ = dtype_info(dtype)
    params = param_count(config)
    flops = forward_flops(config, seq_len, batch=batch)
    flops_causal = forward_flops(config, seq_len, batch=batch, causal_skip=True)
    mem = attention_memory(config, seq_len, batch=batch, dtype=dt, n_layers=n_layers)
    per_token = kv_cache_bytes_per_token(config, dtype=dt, n_layers=n_layers)
    held = seq_len if sliding_window is None else min(seq_len, check_positive("sliding_window", sliding_window))
    return {
        "config": config.to_dict() | {"kind": config.kind, "group_size": config.group_size},
        "seq_len": seq_len, "batch": batch, "dtype": dt, "n_layers": n_layers,
        "params": {
            "layer": params.to_dict(),
            "layer_without_bias": param_count(config, bias=False).total,
            "all_layers": params.total * n_layers,
        },
        "flops": {
            "layer": flops.to_dict(),
            "layer_attention_causal_skip": flops_causal.attention,
            "all_layers": flops.total * n_layers,
        },
        "kv_cache": {
            "per_token_layer_bytes": kv_cache_bytes_per_token(config, dtype=dt),
            "per_token_bytes": per_token,
            "per_1k_tokens_bytes": per_token * 1000,
            "positions": held, "sliding_window": sliding_window,
            "context_bytes": kv_cache_bytes(config, held, batch=batch, dtype=dt, n_layers=n_layers),
        },
        "probabilities": mem.to_dict(),
    }
