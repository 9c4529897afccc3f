"""The layer's configuration inside its state dict, so a checkpoint of another head layout is refused.

The config travels in the state dict's metadata (``state_dict._metadata[prefix]["headwise_config"]``, a
plain dict of ints/floats/bools/None), not as a key: ``state_dict()`` keeps exactly the four projections'
tensors, so plain ``q/k/v/out_proj`` state dicts (and code that treats every value as a tensor) keep
working, and ``torch.load(weights_only=True)`` accepts it. Loading compares it before any weight is copied.
A state dict without it (built by hand, or rebuilt as a plain dict) is loaded with PyTorch's usual shape
checks only, which cannot tell ``n_heads=4, d_head=8`` from ``n_heads=8, d_head=4``.

Shapes:
    d: d_model, h: n_heads, h_kv: n_kv_heads, d_h: d_head.
"""

from __future__ import annotations

import math
from typing import Any

from .config import AttentionConfig

CONFIG_KEY = "headwise_config"
# Fields that change the meaning or the shape of the weights (dropout does neither).
_STRUCTURAL = ("d_model", "n_heads", "n_kv_heads", "d_head", "kdim", "vdim", "bias", "out_bias", "scale")


def record(destination: Any, prefix: str, config: AttentionConfig) -> None:
    """Store ``config`` in the metadata of the state dict being built."""
    meta = getattr(destination, "_metadata", None)
    if meta is not None:
        meta.setdefault(prefix[:-1], {})[CONFIG_KEY] = config.to_dict()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9)
    return a == b


def _describe(values: dict[str, Any]) -> str:
    return "AttentionConfig(" + ", ".join(f"{k}={values.get(k)!r}" for k in _STRUCTURAL) + ")"


def check(local_metadata: dict[str, Any], prefix: str, config: AttentionConfig) -> None:
    """Raise ``ValueError`` naming both configurations if the recorded one differs structurally."""
    saved = local_metadata.get(CONFIG_KEY) if isinstance(local_metadata, dict) else None
    if not isinstance(saved, dict):
        return
    mine = config.to_dict()
    diff = [f"{k} {saved.get(k)!r} vs {mine[k]!r}" for k in _STRUCTURAL if not _same(saved.get(k), mine[k])]
    if diff:
        where = f" at {prefix[:-1]!r}" if prefix else ""
        raise ValueError(
            f"state dict{where} was saved from {_describe(saved)} but this layer is {_describe(mine)}; "
            f"they differ in {', '.join(diff)} (checkpoint vs layer). Build the layer from the saved config "
            f"(AttentionConfig(**state_dict._metadata[{prefix[:-1]!r}][{CONFIG_KEY!r}])) to load it"
        )
