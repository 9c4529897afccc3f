"""The result of :func:`headwise.check`: one :class:`PropertyResult` per property, gathered in a :class:`Report`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["PropertyResult", "Report", "PASS", "FAIL", "SKIPPED", "PROPERTY_NAMES", "CORE_PROPERTIES"]

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"

# Every property, in check order (the functions are in :mod:`headwise.checks.properties`).
PROPERTY_NAMES = ("permutation_equivariance", "batch_independence", "causality", "padding_invariance",
                  "softmax_sanity", "head_independence", "dtype_stability")
# Without these a layer has not been shown to be attention at all: a report whose core properties were
# asked for but could not run (skipped) is not OK, whatever else passed.
CORE_PROPERTIES = ("permutation_equivariance", "batch_independence", "softmax_sanity", "head_independence")


@dataclass(frozen=True)
class PropertyResult:
    """One property's verdict.

    ``verdict`` is ``"pass"``, ``"fail"`` or ``"skipped"`` (not applicable to this layer; ``detail`` says
    why). On failure ``counterexample`` names the smallest input that shows it (which batch / token / head)
    and ``deviation`` is the largest change measured, to compare with ``tolerance``.

    Shapes:
        none (scalars and a JSON-ready dict).

    Example:
        >>> r = PropertyResult("batch_independence", "pass", "3 samples", deviation=0.0, tolerance=1e-9)
        >>> r.passed, r.failed
        (True, False)
    """

    name: str
    verdict: str
    detail: str = ""
    counterexample: dict[str, Any] | None = None
    deviation: float | None = None
    tolerance: float | None = None

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    @property
    def failed(self) -> bool:
        return self.verdict == FAIL

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "verdict": self.verdict, "detail": self.detail,
                "counterexample": self.counterexample, "deviation": self.deviation, "tolerance": self.tolerance}


@dataclass(frozen=True)
class Report:
    """Every property checked on one layer. ``ok`` is True only when at least one property ran, none
    failed, and none of the :data:`CORE_PROPERTIES` that were asked for was skipped (``not_verified``).

    Shapes:
        none.

    Example:
        >>> rep = Report("f", 8, "torch.float64", 0, [PropertyResult("causality", "skipped", "not causal")])
        >>> rep.ok, rep.failed, rep.verdict
        (False, [], 'NOTHING CHECKED: every property asked for was skipped')
        >>> rep = Report("f", 8, "float64", 0, [PropertyResult("batch_independence", "pass"),
        ...                                     PropertyResult("softmax_sanity", "skipped", "no weights")])
        >>> rep.ok, rep.not_verified, rep.verdict
        (False, ['softmax_sanity'], 'NOT VERIFIED: core properties could not run: softmax_sanity (no weights)')
    """

    layer: str
    d_model: int
    dtype: str
    seed: int
    results: list[PropertyResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return any(r.passed for r in self.results) and not self.failed and not self.not_verified

    @property
    def not_verified(self) -> list[str]:
        """Core properties (:data:`CORE_PROPERTIES`) that were asked for but skipped."""
        return [r.name for r in self.results if r.name in CORE_PROPERTIES and r.verdict == SKIPPED]

    @property
    def counts(self) -> dict[str, int]:
        """How many properties passed, failed and were skipped."""
        return {v: sum(r.verdict == v for r in self.results) for v in (PASS, FAIL, SKIPPED)}

    @property
    def verdict(self) -> str:
        """One line: ``OK``, ``FAILED: names``, ``NOT VERIFIED: ...`` or ``NOTHING CHECKED: ...``."""
        if self.failed:
            return "FAILED: " + ", ".join(self.failed)
        if self.not_verified:
            why = [f"{r.name} ({r.detail})" if r.detail else r.name for r in self.results if r.name in self.not_verified]
            return "NOT VERIFIED: core properties could not run: " + ", ".join(why)
        if not any(r.passed for r in self.results):
            return "NOTHING CHECKED: every property asked for was skipped"
        return "OK"

    @property
    def tally(self) -> str:
        """``"7 properties: 5 ran (5 passed, 0 failed), 2 skipped"``."""
        n = self.counts
        noun = "property" if len(self.results) == 1 else "properties"
        return (f"{len(self.results)} {noun}: {n[PASS] + n[FAIL]} ran ({n[PASS]} passed, {n[FAIL]} failed), "
                f"{n[SKIPPED]} skipped")

    @property
    def failed(self) -> list[str]:
        """Names of the properties that failed, in check order."""
        return [r.name for r in self.results if r.failed]

    def __getitem__(self, name: str) -> PropertyResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"no property {name!r} in this report; have {[r.name for r in self.results]}")

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "d_model": self.d_model, "dtype": self.dtype, "seed": self.seed,
                "ok": self.ok, "verdict": self.verdict, "failed": self.failed, "not_verified": self.not_verified,
                "counts": self.counts, "seconds": round(self.seconds, 3),
                "results": [r.to_dict() for r in self.results]}

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(property, verdict, deviation / tolerance, counterexample or reason) per property, for tables."""
        out = []
        for r in self.results:
            dev = "" if r.deviation is None else f"{r.deviation:.2e} / {r.tolerance:.1e}"
            what = r.counterexample.get("summary", "") if r.counterexample else r.detail
            out.append((r.name, r.verdict.upper() if r.failed else r.verdict, dev, what))
        return out

    def __str__(self) -> str:
        rows = [("property", "verdict", "deviation / tol", "counterexample or note")] + self.rows()
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"headwise check: {self.layer} (d_model={self.d_model}, {self.dtype}, seed {self.seed}): "
                 f"{self.verdict}; {self.tally}"]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
        return "\n".join(line.rstrip() for line in lines)
