"""headwise: multi-head attention in which the single head is a first-class object.

``import headwise`` needs only torch; :mod:`headwise.interop`, :mod:`headwise.viz` and the other optional
parts load on first use. ``headwise.trace(model, capture=..., edit=...)`` (:func:`headwise.tracing.trace`)
captures and edits every head inside a model's own forward; :mod:`headwise.patching` sweeps them.

Example:
    >>> import torch, headwise
    >>> attn = headwise.MultiHeadAttention(d_model=32, n_heads=4)
    >>> attn(torch.randn(2, 3, 32)).shape
    torch.Size([2, 3, 32])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - for type checkers; at run time the names load on first use
    from . import functional, masks
    from .attention import MultiHeadAttention
    from .config import AttentionConfig
    from .decoding import DecodeStep
    from .dispatch import DispatchInfo, MaterializationWarning
    from .head import AttentionHead
    from .kv_cache import KVCache
    from .plan import Plan
    from .rotary import RotaryEmbedding

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig",
    "AttentionHead",
    "DecodeStep",
    "DispatchInfo",
    "MultiHeadAttention",
    "KVCache",
    "MaterializationWarning",
    "Plan",
    "RotaryEmbedding",
    "functional",
    "masks",
]

# Every public name loads on first attribute access, so that `python -m headwise --help` (which imports
# this package) does not pay for importing torch.
_NAMES = {"AttentionConfig": "config", "AttentionHead": "head", "DecodeStep": "decoding", "DispatchInfo": "dispatch",
          "MultiHeadAttention": "attention", "KVCache": "kv_cache", "MaterializationWarning": "dispatch",
          "Plan": "plan", "RotaryEmbedding": "rotary"}
# Optional parts, imported on first attribute access so that `import headwise` needs only torch.
_LAZY_MODULES = {"interop", "analysis", "viz", "parallel", "checks", "cli", "presets", "functional", "masks",
                 "plan", "dispatch", "chunking", "validation", "tracing", "patching", "surgery"}


def __getattr__(name: str) -> Any:
    if name == "check":  # headwise.check(layer, ...) is headwise.checks.check, loaded on first use
        return importlib.import_module(".checks", __name__).check
    if name == "trace":  # headwise.trace(model, ...) is headwise.tracing.trace, loaded on first use
        return importlib.import_module(".tracing", __name__).trace
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'headwise' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _LAZY_MODULES | {"check", "trace"})
