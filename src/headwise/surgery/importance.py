"""Which heads matter, scored on your data: by the gradient of a metric with respect to a per-head gate
(Michel et al., 2019), or by ablating each head in turn. One call each, returning a (layers, heads) tensor.

Both run the model's own forward under :func:`headwise.trace` edits (no weight is modified):

* :func:`gradient_importance`: every head's context is multiplied by a gate ``xi[l, h] = 1``; the score is
  ``mean over batches of |d metric / d xi[l, h]|`` (the paper's head importance; ``normalize=True`` divides
  each layer's scores by their L2 norm, as the paper does before pruning across layers).
* :func:`ablation_importance`: ``mean over batches of metric(head ablated) - metric(unchanged)`` for every
  head, ablated by a trace edit (``"zero"`` by default, or ``"mean"``): one forward per head.

``data`` is one model input (a tensor, a tuple of positional inputs, or any mapping of keyword inputs: a dict,
a tokenizer's ``BatchEncoding``) or a list of such batches; ``metric(output)`` or ``metric(output, inputs)``
(the inputs of that batch, e.g. for mean pooling over the attention mask) returns a scalar. Both run the model
in eval mode for their duration (dropout off: a score is the same number on every run) and give every module
its own mode back afterwards; ``progress`` shows a bar (see :mod:`headwise.tracing.progress`).

Shapes:
    L: traced layers, h: heads (the widest layer's; NaN pads layers with fewer heads), b: batch.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..tracing import find_layers, trace
from ..tracing.inputs import call, check_inputs, differentiable, eval_mode, metric_of
from ..tracing.progress import check_progress, progress_bar

__all__ = ["gradient_importance", "ablation_importance"]


def _batches(data: Any, what: str) -> list[Any]:
    batches = data if isinstance(data, list) else [data]
    if not batches:
        raise ValueError(f"{what}: data is an empty list; pass at least one batch")
    for i, inputs in enumerate(batches):
        check_inputs(inputs, what if len(batches) == 1 else f"{what}, batch {i}")
    return batches


def _scalar(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    if value.numel() != 1 or not value.is_floating_point():
        raise ValueError(f"{what}: metric must return one floating number (a scalar tensor), got "
                         f"{value.dtype} of shape {tuple(value.shape)}")
    return value.reshape(())


def _grid(model: nn.Module) -> tuple[list[int], torch.Tensor, torch.device]:
    found = find_layers(model)
    heads = [layer.n_heads for _, layer in found]
    # Not a layer's q_proj: multi-head latent attention (and CodeGen's sharded qkv) has none located, and a
    # trace edit needs none. The gates live where the model's parameters do.
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    return heads, torch.full((len(heads), max(heads)), float("nan"), dtype=torch.float64), device


def gradient_importance(model: nn.Module, data: Any, metric: Callable[..., Any], *,
                        normalize: bool = False, progress: bool | None = None) -> torch.Tensor:
    """Head importance ``E |d metric / d xi[l, h]|`` at gates ``xi = 1`` (Michel et al., 2019).

    Args:
        model: a MultiHeadAttention, a module containing them, or a patched Hugging Face model.
        data: one input or a list of batches.
        metric: output (or output, inputs) -> scalar tensor that autograd can differentiate (e.g. a loss).
        normalize: divide each layer's scores by their L2 norm.
        progress: a progress bar over the batches: None (on a terminal or in a notebook), True or False.

    Shapes:
        -> (L, h) float64

    Example:
        >>> import torch, headwise
        >>> from headwise.surgery import gradient_importance
        >>> attn = headwise.MultiHeadAttention(d_model=8, n_heads=2)
        >>> gradient_importance(attn, torch.randn(3, 4, 8), lambda y: y.square().mean()).shape
        torch.Size([1, 2])
    """
    if not isinstance(normalize, bool):  # a truthy "no" would silently normalize
        raise TypeError(f"gradient_importance: normalize must be True or False, got {type(normalize).__name__} "
                        f"({normalize!r})")
    measure = metric_of(metric, "gradient_importance")
    check_progress(progress, "gradient_importance")
    heads, scores, device = _grid(model)
    total = torch.zeros(len(heads), max(heads), dtype=torch.float64)
    batches = _batches(data, "gradient_importance")
    with eval_mode(model), progress_bar(len(batches), "gradient_importance", progress) as advance:
        for inputs in batches:
            gates = torch.ones(len(heads), max(heads), device=device, requires_grad=True)
            edit = {(li, i): (lambda z_h, layer, head: z_h * gates[layer, head].to(z_h.dtype))
                    for li, h in enumerate(heads) for i in range(h)}
            with torch.enable_grad(), trace(model, edit=edit):
                value = differentiable(measure(call(model, inputs), inputs), "gradient_importance")
                grad, = torch.autograd.grad(value, gates, allow_unused=True)
            if grad is not None:
                total += grad.detach().abs().double().cpu()
            advance(1)
    for li, h in enumerate(heads):
        row = total[li, :h] / len(batches)
        if normalize:
            row = row / row.norm().clamp_min(torch.finfo(torch.float64).tiny)
        scores[li, :h] = row
    return scores


@torch.no_grad()
def ablation_importance(model: nn.Module, data: Any, metric: Callable[..., Any], *,
                        edit: Any = "zero", progress: bool | None = None) -> torch.Tensor:
    """``metric(with head (l, h) ablated) - metric(unchanged)``, averaged over batches, for every head.

    Args:
        model: a MultiHeadAttention, a module containing them, or a patched Hugging Face model.
        data: one input or a list of batches.
        metric: output (or output, inputs) -> scalar.
        edit: the :func:`headwise.trace` edit that ablates a head (``"zero"``, ``"mean"``, a number ...).
        progress: a progress bar over the heads: None (on a terminal or in a notebook), True or False.

    Shapes:
        -> (L, h) float64

    Example:
        >>> import torch, headwise
        >>> from headwise.surgery import ablation_importance
        >>> attn = headwise.MultiHeadAttention(d_model=8, n_heads=2)
        >>> ablation_importance(attn, torch.randn(3, 4, 8), lambda y: y.square().mean()).shape
        torch.Size([1, 2])
    """
    measure = metric_of(metric, "ablation_importance")
    check_progress(progress, "ablation_importance")
    heads, scores, _ = _grid(model)
    batches = _batches(data, "ablation_importance")

    def value(inputs: Any) -> torch.Tensor:
        return _scalar(measure(call(model, inputs), inputs), "ablation_importance").double()

    with eval_mode(model):
        base = [value(b) for b in batches]
        with progress_bar(sum(heads), "ablation_importance", progress) as advance:
            for li, h in enumerate(heads):
                for i in range(h):
                    diffs = []
                    for inputs, ref in zip(batches, base):
                        with trace(model, edit={(li, i): edit}):
                            diffs.append(value(inputs) - ref)
                    scores[li, i] = torch.stack(diffs).mean()
                    advance(1)
    return scores
