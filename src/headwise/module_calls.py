"""What calling an ``nn.Module`` runs besides its forward: hooks, its own and global ones.

A fast route may skip a module call (and compute its output elsewhere) only where the call is exactly the
forward; these predicates say when.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["calls_forward_only", "has_forward_hooks", "bare_linear"]


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
