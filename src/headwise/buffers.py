"""Large CPU tensors on transparent huge pages.

headwise allocates a few large, long-lived CPU tensors itself: the packed projection weights, the KV
cache, and captures such as every head's residual write ``(b, s, h, d)``; and one short-lived one, a long
prompt's packed Q/K/V product (:func:`scratch_empty`), which glibc would map fresh on 4 KiB pages. A
one-row decode step streams the weights and the cache once per token, and a capture or a product lands in
memory the process has never touched; with 4 KiB pages both pay for page-table walks (and fresh memory for
a fault per page), which on a virtual machine can cost more than the arithmetic. Such a tensor gets
memory of its own, mapped fresh and advised ``MADV_HUGEPAGE`` before anything is written, so Linux backs
it with 2 MiB pages where transparent huge pages are "always" or "madvise". It is an ordinary tensor
otherwise (saved, shared and copied as any other); its memory goes back to the system when the last tensor
viewing it is freed. Elsewhere, on other devices, or below :data:`HUGE_BYTES`, this is ``torch.empty``.

Shapes:
    any shape; only CPU tensors are placed on huge pages.
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["fresh_empty", "huge_pages_advised", "scratch_empty", "HUGE_BYTES", "MAPPED_BYTES"]

#: Below this size a tensor comes from the allocator as usual (the saving is per 2 MiB page). Set it to
#: ``math.inf`` to turn huge pages off.
HUGE_BYTES = 4 * 2**20
#: glibc's largest mmap threshold on 64-bit Linux. A block at least this large is mapped fresh, on 4 KiB
#: pages, whenever no free chunk of the heap fits it: a call that makes and frees one pays a fault per page,
#: every time. Below it, freed blocks are reused and the allocator is the better choice.
MAPPED_BYTES = 32 * 2**20
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)


def fresh_empty(shape: tuple[int, ...], dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> torch.Tensor:
    """An uninitialised tensor like ``torch.empty(shape, dtype=dtype, device=device)``, placed on huge pages
    when it is a large CPU tensor (:data:`HUGE_BYTES` and up) and the platform allows it.

    Example:
        >>> t = fresh_empty((4, 3), torch.float32, torch.device("cpu"))
        >>> t.shape, t.dtype, t.is_contiguous()
        (torch.Size([4, 3]), torch.float32, True)
    """
    dtype = dtype or torch.get_default_dtype()
    t = _mapped(shape, dtype, device, HUGE_BYTES)
    return torch.empty(shape, dtype=dtype, device=device) if t is None else t


def scratch_empty(shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device | str | None = None) -> torch.Tensor | None:
    """An uninitialised CPU tensor on fresh huge pages for a result that one call makes and frees, when it
    is at least :data:`MAPPED_BYTES` (and :data:`HUGE_BYTES`): glibc would map it fresh anyway, on 4 KiB
    pages. None otherwise: the caller lets the allocator make it (a smaller block is reused, not mapped).

    Example:
        >>> scratch_empty((4, 3), torch.float32, torch.device("cpu")) is None
        True
    """
    return _mapped(shape, dtype, device, max(HUGE_BYTES, MAPPED_BYTES))


def _mapped(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None,
            min_bytes: float) -> torch.Tensor | None:
    """A CPU tensor on a fresh mapping advised for huge pages, or None (too small, not CPU, not possible)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if _ADVICE is None or nbytes < min_bytes:  # first, and cheap: a decode step asks every token
        return None
    if (torch.device(device) if device is not None else torch.get_default_device()).type != "cpu":
        return None
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(_ADVICE)
    except (OSError, ValueError):  # no anonymous mappings or no such advice here: the ordinary allocation
        return None
    return torch.frombuffer(region, dtype=dtype).view(shape)


def huge_pages_advised(t: torch.Tensor) -> bool:
    """Whether the memory in the middle of ``t`` is advised for huge pages (Linux: the ``hg`` flag of its
    mapping in ``/proc/self/smaps``); False where that cannot be read. Reads a file: not for hot paths.

    Example:
        >>> huge_pages_advised(torch.zeros(3))
        False
    """
    if t.device.type != "cpu" or t.untyped_storage().nbytes() == 0:
        return False
    address = t.untyped_storage().data_ptr() + t.untyped_storage().nbytes() // 2
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
                    lo, hi = (int(a, 16) for a in head.split("-"))
                    inside = lo <= address < hi
                elif inside and head == "VmFlags:":
                    return "hg" in line.split()[1:]
    except OSError:
        return False
    return False
