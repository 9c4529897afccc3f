"""What the properties (:mod:`.properties`) share: the :class:`Probe` (adapter, seeded inputs, tolerances) and how
deviations are measured and reported.

Shapes:
    b: batch, s: tokens, d: d_model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .adapters import Adapter
from .report import FAIL, SKIPPED, PropertyResult

__all__ = ["RTOL", "DTYPE_RTOL", "Probe", "deviation", "first_index", "nonfinite", "skip"]

# Relative tolerances: reorderings of float sums cost a few ulps times the reduction length.
# Half precisions: two correct computations of the same output (a fused path and an eager weights path) each round
# q/k/v, scores, weights, contexts and the output, every rounding up to eps/2 of the largest value it feeds; their
# difference reaches a few eps of the output's scale (bfloat16: 4 * 2**-7 = 3.1e-2, float16: 4 * 2**-10 = 3.9e-3).
RTOL = {torch.float64: 1e-9, torch.float32: 2e-5,
        torch.bfloat16: 4 * torch.finfo(torch.bfloat16).eps, torch.float16: 4 * torch.finfo(torch.float16).eps}
# float32 vs float64 of the same layer: float32 rounding through projections and softmax.
DTYPE_RTOL = 1e-4


@dataclass
class Probe:
    """What the properties share: the adapter in the compute dtype, seeded inputs and tolerances.

    Shapes:
        x: (b, s, d); keep: (b, s) bool, True = real token (sample 0 full, 1 right-padded, 2 left-padded)
    """

    adapter: Adapter
    x: torch.Tensor
    keep: torch.Tensor
    generator: torch.Generator
    seed: int
    computed: torch.dtype | None = None  # the precision the layer was seen to compute its weights in, if lower

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def rtol(self) -> float:
        rtol = RTOL.get(self.dtype, RTOL[torch.bfloat16])
        for precision in (self.adapter.precision, self.computed):
            if precision is not None:
                rtol = max(rtol, RTOL.get(precision, RTOL[torch.bfloat16]))
        return rtol

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, dtype=torch.float64).to(self.dtype).to(self.x.device)

    def tol(self, reference: torch.Tensor, rtol: float | None = None) -> float:
        finite = reference[torch.isfinite(reference)]
        scale = float(finite.abs().max()) if finite.numel() else 1.0
        return (self.rtol if rtol is None else rtol) * max(scale, 1e-12)


def deviation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise |a - b| where non-finite values count as infinitely wrong (unless identical)."""
    d = (a.double() - b.double()).abs()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))  # the same inf, or NaN in both: no change
    bad = ~(torch.isfinite(a) & torch.isfinite(b)) & ~same
    return torch.where(bad, torch.full_like(d, math.inf), torch.where(same, torch.zeros_like(d), d))


def first_index(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def nonfinite(name: str, y: torch.Tensor) -> PropertyResult | None:
    if torch.isfinite(y).all():
        return None
    idx = first_index(~torch.isfinite(y))
    return PropertyResult(name, FAIL, "the layer's output is not finite",
                          {"index": list(idx), "summary": f"non-finite output at (batch, token, ...) = {idx}"},
                          math.inf, 0.0)


def skip(name: str, why: str) -> PropertyResult:
    return PropertyResult(name, SKIPPED, why)
