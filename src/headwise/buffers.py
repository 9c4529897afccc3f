"""Large fresh CPU tensors on transparent huge pages.

A capture such as every head's residual write, ``(b, s, h, d)`` floats, is h times the layer's output and
lands in memory the process has never touched: each 4 KiB page faults on first write, and on a virtual
machine those faults cost more than computing the values. Memory mapped and advised ``MADV_HUGEPAGE``
faults in 2 MiB pages instead (Linux, where transparent huge pages are "always" or "madvise"); anywhere
else, or below :data:`HUGE_BYTES`, this is ``torch.empty``. The tensor owns its mapping: the memory goes
back to the system when the last tensor viewing it is freed.

Shapes:
    any shape; only CPU tensors are placed on huge pages.
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["fresh_empty", "HUGE_BYTES"]

#: Below this size a buffer comes from the allocator as usual (the saving is per 2 MiB page).
HUGE_BYTES = 32 * 2**20
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)


def fresh_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor like ``torch.empty(shape, dtype=dtype, device=device)``, placed on huge pages
    when it is a large CPU tensor and the platform allows it.

    Example:
        >>> t = fresh_empty((4, 3), torch.float32, torch.device("cpu"))
        >>> t.shape, t.dtype, t.is_contiguous()
        (torch.Size([4, 3]), torch.float32, True)
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if _ADVICE is None or torch.device(device).type != "cpu" or nbytes < HUGE_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(_ADVICE)
    except (OSError, ValueError):  # no anonymous mappings or no such advice here: the ordinary allocation
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.frombuffer(region, dtype=dtype).view(shape)
