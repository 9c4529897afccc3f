"""What :func:`~headwise.parallel.tensor.tensor_parallel` carries from the unsharded layer into a shard, and the
layers it refuses because a shard would compute less than they do.

A shard is built from copies of the layer's parts: the slices of its four ``nn.Linear`` projections, its rotary
embedding and, for a layer with per-head Q/K norms (QK-norm: the ``QKNormAttention`` that
:func:`headwise.interop.from_hf` returns for Qwen3 or Gemma 3), copies of the norms. A norm acts on each head's
``d_h`` features with the same weights for every head, so every shard holds it whole. A layer that computes
anything else is refused with a ``TypeError`` saying what would be lost: a subclass overriding a step of the
forward, a projection that is more than its weight and bias (a LoRA wrapper), a live view of another module's
weights (a patched Hugging Face module's layer).

Shapes:
    q_norm, k_norm: (..., d_h) -> (..., d_h), over each split head's features
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..attention import MultiHeadAttention
from ..module_calls import FORWARD_STEPS, has_own_forward_hooks

__all__ = ["check_source", "qk_norms"]

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")
# headwise's QK-norm steps, which a shard applies with copies of the norms. Matched by name: the class lives in
# the Hugging Face interop, which is not imported here (a layer of that class has imported it already).
_QK_NORM = ("headwise.interop.hf.qk_norm", "QKNormMixin")
_QK_NORM_STEPS = ("project_q", "project_kv", "project_qkv")
_VIEW = ("headwise.interop.views", "LayerView")


def _where(cls: type) -> tuple[str, str]:
    return cls.__module__, cls.__name__


def qk_norms(attn: MultiHeadAttention) -> tuple[nn.Module, nn.Module] | None:
    """``attn``'s per-head Q/K norms ``(q_norm, k_norm)`` if it is a headwise QK-norm layer, else None."""
    if any(_where(c) == _QK_NORM for c in type(attn).__mro__):
        return attn.q_norm, attn.k_norm
    return None


def check_source(attn: MultiHeadAttention) -> None:
    """Raise ``TypeError`` naming what a shard of ``attn`` would not compute; return if it computes all of it.

    Example:
        >>> from headwise import MultiHeadAttention
        >>> class Scaled(MultiHeadAttention):
        ...     def project_out(self, z, results=None):
        ...         return 2 * super().project_out(z, results)
        >>> check_source(MultiHeadAttention(16, 4))
        >>> check_source(Scaled(16, 4))
        Traceback (most recent call last):
            ...
        TypeError: tensor_parallel cannot shard Scaled: it overrides the forward step Scaled.project_out; a shard computes only its four nn.Linear projections, rotary embedding and per-head Q/K norms
    """
    problems = []
    overridden = []
    for step in FORWARD_STEPS:
        owner = next(c for c in type(attn).__mro__ if step in vars(c))
        if owner is not MultiHeadAttention and not (_where(owner) == _QK_NORM and step in _QK_NORM_STEPS):
            overridden.append(f"{owner.__name__}.{step}")
    overridden += [f"{step} (set on the instance)" for step in FORWARD_STEPS if step in vars(attn)]
    if overridden:
        problems.append(f"it overrides the forward step{'s' if len(overridden) > 1 else ''} {', '.join(overridden)}")
    odd: dict[str, str] = {}
    for name in PROJECTIONS:
        proj = getattr(attn, name, None)
        assigned = "forward" in getattr(proj, "__dict__", {})  # a forward assigned on the instance: not F.linear
        if type(proj) is not nn.Linear or assigned:
            odd[name] = type(proj).__qualname__ + (" with a forward set on the instance" if assigned else "")
    if odd:
        problems.append("its projections " + ", ".join(f"{k}={v}" for k, v in odd.items()) + " are not plain "
                        "nn.Linear, and a shard keeps only their weight and bias (merge an adapter first, e.g. "
                        "PEFT's merge_and_unload(), or wrap the shard's projections after tensor_parallel)")
    hooked = [name for name, m in [("the layer", attn)] + [(n, getattr(attn, n, None)) for n in PROJECTIONS]
              if isinstance(m, nn.Module) and has_own_forward_hooks(m)]
    if hooked:  # a shard is a new module: hooks stay on the modules they were registered on
        problems.append(f"{', '.join(hooked)} {'has' if len(hooked) == 1 else 'have'} forward hooks, which a shard "
                        "does not carry (register them on the shard's modules after tensor_parallel)")
    if not problems:
        return
    hint = ("; it is a view of another module's weights: shard a standalone copy "
            "(headwise.interop.from_hf(module) or from_torch(module))"
            if any(_where(c) == _VIEW for c in type(attn).__mro__) else "")
    raise TypeError(f"tensor_parallel cannot shard {type(attn).__name__}: {'; '.join(problems)}; a shard computes "
                    f"only its four nn.Linear projections, rotary embedding and per-head Q/K norms{hint}")
