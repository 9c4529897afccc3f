"""Projections on MKL's packed GEMM: an opt-in speed-up of float32 CPU inference at a fixed row count.

An ``nn.Linear`` call reads its weight in the stored ``(out, in)`` layout and re-blocks it inside the GEMM on
every call. MKL can block a weight once (``cblas_sgemm_pack``) and run later calls on that copy
(``cblas_sgemm_compute``); PyTorch exposes the pair as ``torch.ops.mkl._mkl_reorder_linear_weight`` and
``torch.ops.mkl._mkl_linear`` (what inductor's freezing uses). A packed copy is made for one row count
``rows`` (``b * s_q`` of the calls it serves: 1 when decoding one sequence); calls with other row counts run
the ordinary GEMM. On the 2-core CI machine a one-token decode step at d_model 4096 took 0.91-0.94x the
default time at h_kv 32 and 0.92-1.00x at h_kv 8 (the decode rows of ``benchmarks/RESULTS.md``); small weights
that stay in cache gained nothing or lost.

Why it is opt-in (:meth:`headwise.MultiHeadAttention.use_packed_gemm`):

* memory: the packed copy lives next to the weight (1.13x its size at 4096 x 4096), because the weight
  stays the parameter that autograd, ``state_dict``, head views and other row counts read;
* float32 on CPU, in a PyTorch build with MKL, only; weights made under ``torch.inference_mode`` are refused
  (inference tensors have no version counter, so a later write could not be detected);
* no autograd: a call that needs gradients, runs under ``torch.compile``, goes to a projection with hooks, or
  goes to a projection module that was replaced (anything but a plain ``nn.Linear``) runs the ordinary path.

A packed copy is used only while the weight is still the tensor it was made from: the same storage (the copy
keeps a reference to it, so its address cannot be reused by another tensor), shape and strides, and the same
version counter, which every in-place write bumps (``optimizer.step()``, ``load_state_dict``, writes through
head views); replacing ``.data`` changes the storage. After either the copy is rebuilt on the next call that
uses it. In-place writes into ``.data`` bypass version counting (as they bypass autograd's own checks): call
``use_packed_gemm`` again after one.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

__all__ = ["available", "PackedWeight", "linear", "check_rows", "check_weight"]


@functools.lru_cache(maxsize=None)  # a property of the build, asked on every packed call
def available() -> bool:
    """Whether this PyTorch build has MKL's packed GEMM (x86 builds with MKL do; e.g. macOS arm64 does not).

    Example:
        >>> isinstance(available(), bool)
        True
    """
    if not torch.backends.mkl.is_available():
        return False
    ops = torch.ops.mkl
    return hasattr(ops, "_mkl_reorder_linear_weight") and hasattr(ops, "_mkl_linear")


def check_rows(rows: object) -> int | None:
    """Validate a row count for :func:`linear` (None: packing off)."""
    if rows is None:
        return None
    if isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0:
        raise ValueError(f"rows must be a positive int (b * s_q of the calls to speed up) or None, got {rows!r}")
    return rows


def check_weight(name: str, weight: torch.Tensor) -> None:
    """Packing needs a float32 CPU weight; anything else is refused with the received dtype/device."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise TypeError(f"packed GEMM needs float32 weights on the CPU; {name}.weight is {weight.dtype} on "
                        f"{weight.device}")
    if weight.is_inference():
        raise ValueError(f"packed GEMM needs weights whose in-place writes are tracked; {name}.weight is an "
                         "inference tensor (made under torch.inference_mode), which has no version counter")


class PackedWeight:
    """One weight blocked for MKL's GEMM, valid for calls of exactly ``rows`` rows while the weight is unchanged.

    Shapes:
        weight: (out, in); calls: x (..., in) with x.numel() // in == rows -> (..., out)
    """

    __slots__ = ("rows", "source", "version", "shape", "stride", "blocked")

    def __init__(self, weight: torch.Tensor, rows: int) -> None:
        self.rows = rows
        self.source = weight.detach()  # shares storage (kept alive, so its address stays unique) and version counter
        self.version = weight._version
        self.shape, self.stride = tuple(weight.shape), weight.stride()
        self.blocked = torch.ops.mkl._mkl_reorder_linear_weight(self.source.contiguous(), rows)

    def matches(self, weight: torch.Tensor, rows: int) -> bool:
        """Whether this copy still equals ``weight`` (same storage, layout and version) and serves ``rows``."""
        return (rows == self.rows and weight.data_ptr() == self.source.data_ptr() and weight._version == self.version
                and tuple(weight.shape) == self.shape and weight.stride() == self.stride)


def _hooked(proj: nn.Module) -> bool:
    if proj._forward_hooks or proj._forward_pre_hooks:
        return True
    return bool(getattr(_nn_module, "_global_forward_hooks", None)
                or getattr(_nn_module, "_global_forward_pre_hooks", None))


def linear(proj: nn.Module, x: torch.Tensor, rows: int | None, packs: dict[str, PackedWeight],
           name: str) -> torch.Tensor:
    """``proj(x)``, on MKL's packed GEMM when ``x`` has ``rows`` rows and nothing rules it out (see the module
    docstring); ``packs[name]`` is made or rebuilt here when missing or stale.

    Shapes:
        x: (..., in) -> (..., out)

    Example:
        >>> lin = nn.Linear(8, 4)
        >>> x = torch.randn(1, 1, 8)
        >>> packs = {}
        >>> with torch.no_grad():
        ...     y = linear(lin, x, 1, packs, "q_proj")
        ...     torch.testing.assert_close(y, lin(x))
        >>> sorted(packs) == (["q_proj"] if available() else [])
        True
    """
    # is_compiling() first: dynamo then traces the ordinary path without reaching checks it cannot trace.
    if (rows is None or torch.compiler.is_compiling() or type(proj) is not nn.Linear or x.dtype != torch.float32
            or x.device.type != "cpu"):
        return proj(x)
    weight, bias = proj.weight, proj.bias
    if (x.numel() != rows * x.shape[-1] or x.shape[-1] != weight.shape[-1] or weight.dtype != torch.float32
            or weight.device.type != "cpu" or weight.is_inference()
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad)))
            or _hooked(proj) or not available()):
        return proj(x)
    pack = packs.get(name)
    if pack is None or not pack.matches(weight, rows):
        pack = packs[name] = PackedWeight(weight, rows)
    return torch.ops.mkl._mkl_linear(x, pack.blocked, weight, bias, rows)
