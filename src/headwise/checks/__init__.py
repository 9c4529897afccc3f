"""``headwise.check``: black-box property tests that tell whether a layer is actually attention.

Seven named properties, each with a verdict and a minimal counterexample (see
:mod:`headwise.checks.properties`): permutation equivariance, batch independence, causality (and
decode-with-cache == full pass), padding invariance, softmax sanity (rows sum to 1, masked entries 0,
scale 1/sqrt(d_head)), head independence (heads mix only in W_O), float32 vs float64 stability.
A plain ``f(x) -> y`` is enough for the first three; adapters (:mod:`headwise.checks.adapters`) expose more
of headwise, ``nn.MultiheadAttention`` and every Hugging Face self-attention module on transformers' attention
interface (:mod:`headwise.checks.hf_adapter`).
A report is OK only when the core properties (:data:`CORE_PROPERTIES`: permutation equivariance, batch
independence, softmax sanity, head independence) could run and passed: a layer that exposes no attention
weights or heads is "not verified", never OK.

Shapes:
    b: batch, s: tokens, d: d_model, h: heads, d_h: head width; the layer maps (b, s, d) -> (b, s, d).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .report import CORE_PROPERTIES, FAIL, PASS, PROPERTY_NAMES, SKIPPED, PropertyResult, Report

if TYPE_CHECKING:  # pragma: no cover
    from .adapters import Adapter, CallableAdapter
    from .module_adapter import ModuleAdapter
    from .choose import adapt
    from .run import check
    from .torch_mha import TorchMHAAdapter

__all__ = ["check", "Report", "PropertyResult", "Adapter", "CallableAdapter", "ModuleAdapter",
           "TorchMHAAdapter", "adapt", "PROPERTY_NAMES", "CORE_PROPERTIES"]

# The names that need torch load on first use, so that the CLI can check its arguments (property names)
# before importing torch.
_LAZY = {"check": "run", "Adapter": "adapters", "CallableAdapter": "adapters", "ModuleAdapter": "module_adapter",
         "TorchMHAAdapter": "torch_mha", "adapt": "choose"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
