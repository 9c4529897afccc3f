"""What calling an ``nn.Module`` runs besides its forward: hooks, its own and global ones.

A fast route may skip a module call (and compute its output elsewhere) only where the call is exactly the
forward; these predicates say when.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["calls_forward_only", "has_forward_hooks", "bare_linear", "adapter_base"]


def calls_forward_only(module: nn.Module) -> bool:
    """Whether ``module(...)`` is exactly ``module.forward(...)``: no hook of any kind, its own or global (the
    condition of ``nn.Module``'s own shortcut)."""
    m = nn.modules.module
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or m._global_forward_hooks or m._global_forward_pre_hooks
                or m._global_backward_hooks or m._global_backward_pre_hooks)


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs forward hooks (its own or global ones): then its output may not be
    replaced by a sum computed elsewhere."""
    return bool(module._forward_hooks or module._forward_pre_hooks or nn.modules.module._global_forward_hooks
                or nn.modules.module._global_forward_pre_hooks)


def bare_linear(module: Any) -> bool:
    """Whether calling ``module`` is exactly ``F.linear`` with its weight and bias: an ``nn.Linear`` (not a
    subclass such as a LoRA wrapper) without forward hooks."""
    return type(module) is nn.Linear and not has_forward_hooks(module)


def adapter_base(module: Any) -> nn.Module | None:
    """The layer an adapter wraps (a PEFT tuner layer keeps it as ``base_layer``), or None for a module that
    wraps none. An adapter's delta is not in its base layer's weight: code that reads or rewrites that weight
    must refuse the wrapper or go through it.

    Example:
        >>> adapter_base(nn.Linear(2, 2)) is None
        True
    """
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, nn.Module) else None
