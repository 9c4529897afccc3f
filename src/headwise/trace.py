"""``headwise.trace``, callable: :mod:`headwise.tracing`'s names under this module path.

Calling this module calls :func:`headwise.tracing.trace`, the implementation.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Mapping

from torch import nn

from .tracing import CAPTURABLE, SITES, LayerRecord, Trace, find_layers, head_results, trace

__all__ = ["trace", "Trace", "LayerRecord", "find_layers", "head_results", "CAPTURABLE", "SITES"]


class _CallableModule(types.ModuleType):
    """``headwise.trace`` is this module; calling it calls :func:`trace`."""

    def __call__(self, module: nn.Module, capture: Any = (), edit: Mapping | None = None) -> Trace:
        return trace(module, capture, edit)


sys.modules[__name__].__class__ = _CallableModule
