"""Gradient checkpointing and a trace: refused, since a checkpointed module's backward runs its forward again.

That recompute happens when the backward runs: after the ``with`` block it runs without the trace (so without its
edits: the gradients are those of the unedited model, or torch's checkpoint refuses a recompute that saves other
tensors than the forward did), inside it the trace records it as a second call. Neither is the traced forward,
and torch's checkpoint gives no way to replay the forward's trace, so a trace refuses (``ValueError``) both where
it can see them: a traced module whose submodules turn Hugging Face's gradient checkpointing on (its
``gradient_checkpointing`` flag, in training mode with autograd on: when transformers checkpoints) when the trace
is entered and at each call of it, and a traced layer called while autograd runs a backward (a recompute of
``torch.utils.checkpoint`` used directly), before the layer computes anything.

Shapes:
    no tensors: modules and their flags
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["switches", "refuse_checkpointing", "backward_task", "recompute_refusal"]

#: The id of the backward autograd runs in this thread now, -1 outside one: the test torch's own
#: ``torch.utils.checkpoint`` and ``torch.utils.module_tracker`` use to tell a recompute from a forward. It is
#: not public torch API, so it is looked up once, and a torch without it never refuses.
backward_task: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def switches(module: nn.Module, layers: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``(name, submodule)`` of ``module`` (itself included) carrying a gradient-checkpointing flag (transformers'
    ``gradient_checkpointing`` bool, on a model or on each of its decoder layers) around one of ``layers`` (the
    traced ``(name, layer)`` of :func:`~headwise.tracing.layers.find_layers`): a flag on a part holding no traced
    layer (a vision tower) never recomputes one.

    Example:
        >>> import headwise
        >>> switches(torch.nn.Sequential(headwise.MultiHeadAttention(8, 2)), [("0", None)])
        []
    """
    found = []
    for name, m in module.named_modules():
        if isinstance(getattr(m, "gradient_checkpointing", None), bool) and any(
                not name or n == name or n.startswith(name + ".") for n, _ in layers):
            found.append((name, m))
    return found


def refuse_checkpointing(module: nn.Module, flags: list[tuple[str, nn.Module]]) -> None:
    """``ValueError`` when a call of ``module`` would checkpoint a traced layer: one of ``flags`` (see
    :func:`switches`) on in training mode, with autograd on (transformers checkpoints only then)."""
    if not torch.is_grad_enabled():
        return
    on = [name or type(m).__name__ for name, m in flags if m.training and m.gradient_checkpointing is True]
    if on:
        shown = on[:3] + ([f"... {len(on) - 3} more"] if len(on) > 3 else [])
        raise ValueError(f"trace: {type(module).__name__} has gradient checkpointing on in training mode (in "
                         f"{shown}): its backward runs the traced layers again, after the trace without its edits "
                         "(wrong gradients) or inside it as second calls; turn it off before tracing "
                         "(model.gradient_checkpointing_disable(), in newer transformers "
                         "model.activation_checkpointing_disable()), or trace in eval mode (model.eval()) or "
                         "under torch.no_grad()")


def recompute_refusal(index: int, name: str) -> str:
    """The refusal of traced layer ``index`` (module name ``name``) called while a backward runs."""
    return (f"trace: layer {index} ({name or 'the traced layer'}) was called while autograd runs a backward, "
            "i.e. recomputed by gradient checkpointing (torch.utils.checkpoint): the trace would record the "
            "recompute as a second call, and a backward after the trace recomputes it without the trace's edits; "
            "run the traced module without checkpointing (eval mode, torch.no_grad(), or the module called "
            "directly rather than through torch.utils.checkpoint) while tracing")
