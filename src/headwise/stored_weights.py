"""Whether a projection's weight is a stored float tensor that headwise can slice and write.

A head's weights are slices of its layer's projections, read and written in place. Two things break that
without an error of their own: a quantized module (``torch.ao.quantization``) hands out its packed weight through
a method, and a parametrized one (``torch.nn.utils.parametrize``, or the older ``weight_norm`` hooks) recomputes
its weight from other tensors, so a write into it lands in a temporary. These predicates name the cause, for
messages raised before anything is written.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["packed_weight", "recomputed_weight"]

#: The forward pre-hooks of torch.nn.utils that recompute a weight before each call, and how each is removed.
_OLD_HOOKS = {"WeightNorm": "remove_weight_norm", "SpectralNorm": "remove_spectral_norm"}


def packed_weight(module: object) -> str:
    """Why projection ``module`` holds no float weight tensor to read ("" where it does): a quantized module
    (``torch.ao.quantization.quantize_dynamic`` / ``convert``) hands out its packed weight through a method."""
    w = getattr(module, "weight", None)
    if w is None or isinstance(w, torch.Tensor) or not callable(w):
        return ""
    kind = type(module)
    return (f"a {kind.__module__}.{kind.__qualname__}, whose weight is packed (quantized), not a float tensor: "
            "headwise reads float weights, so take heads, capture 'result' and edit weights before quantizing, or "
            "dequantize")


def recomputed_weight(module: nn.Module, tensor: torch.Tensor) -> str:
    """Why writing into ``tensor`` (a weight ``module`` computes with, or a view of one) would not change ``module``
    ("" where it would): it is no stored parameter or buffer of ``module`` but recomputed from them, on each access
    (``torch.nn.utils.parametrize``: ``parametrizations.weight_norm``, ``orthogonal`` ...) or in a forward pre-hook
    (the older ``torch.nn.utils.weight_norm`` / ``spectral_norm``), so a write would land in a temporary."""
    if tensor.device.type == "meta" or not _plain(tensor):
        return ""  # no data to write, or a tensor subclass (DTensor, ...) whose storage is not its data: as written
    stored = {t.untyped_storage().data_ptr() for t in itertools.chain(module.parameters(), module.buffers())
              if _plain(t)}
    if tensor.untyped_storage().data_ptr() in stored:
        return ""
    by = []
    for path, m in module.named_modules():
        at = f"{path}." if path else ""
        for name, chain in (m.parametrizations.items() if parametrize.is_parametrized(m) else ()):
            originals = ", ".join(f"{at}parametrizations.{name}.{k}" for k, _ in chain.named_parameters(recurse=False))
            by.append(f"{at}{name} is parametrized by {' + '.join(type(p).__name__ for p in chain)} (remove it with "
                      f"torch.nn.utils.parametrize.remove_parametrizations, or write {originals})")
        for hook in m._forward_pre_hooks.values():
            remove = _OLD_HOOKS.get(type(hook).__name__)
            if remove:
                by.append(f"{at}{hook.name} is recomputed by a {type(hook).__name__} hook (remove it with "
                          f"torch.nn.utils.{remove}, or write the tensors it is computed from)")
    if not by:  # a view of another module's tensor (a flat parameter, ...): the write lands there
        return ""
    return f"holds a weight recomputed from other tensors on every use: {'; '.join(by)}: a write into it would be lost"


def _plain(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor or type(t) is nn.Parameter
