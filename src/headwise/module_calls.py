"""What calling an ``nn.Module`` runs besides its forward: hooks, its own and global ones.

A fast route may skip a module call (and compute its output elsewhere) only where the call is exactly the
forward; these predicates say when.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["FORWARD_STEPS", "calls_forward_only", "has_forward_hooks", "has_own_forward_hooks", "bare_linear",
           "adapter_base", "kv_prompt"]

#: The steps of ``MultiHeadAttention.forward``. A subclass, or an instance (a step assigned on it: a notebook's
#: monkeypatch), overriding any of them may compute another function than the weights alone say: a route that
#: computes the forward elsewhere (a decode step's, a conversion, a shard) must see it.
FORWARD_STEPS = ("forward", "project_q", "project_kv", "project_qkv", "rotate", "attend", "project_out")


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


def has_own_forward_hooks(module: nn.Module) -> bool:
    """Whether forward hooks are registered on ``module`` itself (global ones left out): what a copy of its
    weights in another module (a shard) would lose."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def bare_linear(module: Any) -> bool:
    """Whether calling ``module`` is exactly ``F.linear`` with its weight and bias: an ``nn.Linear`` (not a
    subclass such as a LoRA wrapper, nor one whose ``forward`` was assigned on the instance) without forward
    hooks."""
    return type(module) is nn.Linear and "forward" not in module.__dict__ and not has_forward_hooks(module)


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


#: PEFT prompt learning that prepends input embeddings only: the model's keys and values stay its own.
EMBEDDING_PROMPTS = frozenset({"PROMPT_TUNING", "P_TUNING", "MULTITASK_PROMPT_TUNING", "CPT"})


def kv_prompt(config: Any) -> str:
    """The PEFT type of an adapter config whose prompt learning supplies keys and values to every layer (prefix
    tuning: its virtual tokens' past key/values sit before the prompt's), or "" for any other config.

    Example:
        >>> kv_prompt(None)
        ''
    """
    kind = getattr(config, "peft_type", None)
    kind = str(getattr(kind, "value", kind))
    return kind if getattr(config, "is_prompt_learning", False) is True and kind not in EMBEDDING_PROMPTS else ""
