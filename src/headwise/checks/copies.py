"""The working copies :func:`headwise.check` runs a layer on: the check writes into a copy's weights (an identity W_O,
perturbed heads) and runs it in eval mode, so the caller's layer, its tensors and their autograd version counters
stay as they were.

* :func:`copy_adapter`: a shipped adapter (``adapter.module``) on a deep copy of its module.
* :func:`copy_held`: any other adapter (a user's :class:`~headwise.checks.adapters.Adapter` subclass), deep-copied
  whole, with the modules it holds as attributes converted and put in eval mode.

Shapes:
    none (modules and adapters are copied whole).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["copy_adapter", "copy_held"]


def _refusal(name: str, exc: Exception) -> TypeError:
    hint = (" (the legacy torch.nn.utils.weight_norm / spectral_norm keep non-leaf weights: use "
            "torch.nn.utils.parametrizations.weight_norm / spectral_norm)") if "graph leaves" in str(exc) else ""
    return TypeError(f"headwise.check works on a copy of {name} so that the layer passed in is never changed, but "
                     f"copy.deepcopy of it failed: {type(exc).__name__}: {str(exc)[:160]}{hint}")


def _working(module: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    if dtype is not None:
        module = module.to(dtype)
    module.eval()
    _make_inert(module)
    return module


def copy_adapter(adapter: Any, dtype: torch.dtype | None) -> Any:
    """A shallow copy of ``adapter`` on a deep copy of its module, in ``dtype`` (None: the module's own), in eval
    mode, without the caller's hooks and with parametrized weights baked into plain parameters: the check may
    then write into its weights (identity W_O, perturbed heads) while the caller's module stays as it was.

    ``TypeError`` when the module cannot be deep-copied: checking it in place would write into the caller's
    tensors, so it is refused instead."""
    new = copy.copy(adapter)
    try:
        module = copy.deepcopy(adapter.module)
    except Exception as exc:  # whatever the module holds that deepcopy refuses (locks, non-leaf tensors)
        raise _refusal(adapter.name, exc) from exc
    new.module = _working(module, dtype)
    if hasattr(new, "fn"):
        new.fn = new.module
    return new


def copy_held(adapter: Any, dtype: torch.dtype | None) -> Any:
    """A deep copy of ``adapter`` (any class) whose ``nn.Module`` attributes are in ``dtype`` (None: their own), in
    eval mode and without the caller's hooks, as :func:`copy_adapter` makes them; the tensors the adapter's
    ``head_slices`` point into are the copy's, so perturbing them leaves the caller's as they were.

    An adapter that cannot be deep-copied is returned as None where the check writes nothing into it (it exposes no
    heads), and refused with a ``TypeError`` where it would."""
    try:
        new = copy.deepcopy(adapter)
    except Exception as exc:  # a closure over a lock, a non-leaf tensor ...
        if not getattr(adapter, "exposes_heads", False):
            return None
        raise _refusal(getattr(adapter, "name", type(adapter).__name__), exc) from exc
    for name, value in list(vars(new).items()):
        if isinstance(value, nn.Module):
            setattr(new, name, _working(value, dtype))
    return new


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _make_inert(module: nn.Module) -> None:
    """Drop the caller's hooks from a copied module (they would fire on the check's own calls, recording its
    float64 and perturbed runs) and bake parametrizations (weight_norm, spectral_norm, orthogonal ...) into plain
    parameters: a parametrized weight is recomputed on each access, so writing into it (identity W_O, a
    perturbed head) would change nothing. headwise's own hooks (the patch's guards) are kept."""
    from torch.nn.utils import parametrize

    subs = list(module.modules())
    for sub in subs:  # every hook first: baking below runs the parametrizations' own modules
        for attr in _HOOK_DICTS:
            hooks = getattr(sub, attr, None)
            if isinstance(hooks, dict):
                for key in [k for k, hook in hooks.items()
                            if not str(getattr(hook, "__module__", "") or "").startswith("headwise.")]:
                    del hooks[key]
    for sub in subs:
        if parametrize.is_parametrized(sub):
            # by hand: remove_parametrizations would delete the property from the parametrized class, which the
            # copy shares with the caller's module
            with torch.no_grad():
                values = {name: getattr(sub, name).detach().clone() for name in sub.parametrizations}
            del sub._modules["parametrizations"]
            sub.__class__ = type(sub).__bases__[0]  # the class before parametrization
            for name, value in values.items():
                sub.register_parameter(name, nn.Parameter(value, requires_grad=False))
