"""The adversarial sweep: a table of wrong (and a few tricky but valid) calls against the public API, each
classified (tests/robustness/sweep_harness.py): a clear refusal that leaves every model, cache, tensor and
file bit for bit as it was, or the right answer against an independent reference; never a silent wrong
answer, a hang or a traceback.

``pytest -s`` prints the counts (``test_sweep_counts``); with ``HEADWISE_SWEEP_REPORT=FILE`` they are also
written to FILE, one line per case after the summary. Cases marked xfail name what is wrong today.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.robustness import sweep_core, sweep_math, sweep_models, sweep_parts, sweep_research, sweep_tools
from tests.robustness.sweep_harness import Outcome, run_case, summary

CASES = (sweep_core.CASES + sweep_parts.CASES + sweep_math.CASES + sweep_tools.CASES + sweep_models.CASES
         + sweep_research.CASES)
OUTCOMES: dict[str, Outcome] = {}


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})


def _param(case):
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    return pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_sweep(case, tmp_path: Path) -> None:
    outcome = OUTCOMES[case.id] = run_case(case, tmp_path)
    assert outcome.category in ("refused", "worked"), f"{outcome.category}: {outcome.detail}"
    assert outcome.state_ok, f"refused ({outcome.detail}) but changed {outcome.state_detail}"


def test_sweep_counts(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every case (those not run in this process yet are run here): the only unclean outcomes are the cases
    marked xfail, and the counts are printed (and written to $HEADWISE_SWEEP_REPORT)."""
    for case in CASES:
        if case.id not in OUTCOMES:
            OUTCOMES[case.id] = run_case(case, tmp_path_factory.mktemp("sweep"))
    outcomes = {c.id: OUTCOMES[c.id] for c in CASES}
    line = summary(outcomes)
    known = [c.id for c in CASES if c.xfail]
    print(f"\n{line} (xfail today: {len(known)})")
    report = os.environ.get("HEADWISE_SWEEP_REPORT")
    if report:
        rows = [f"{cid}\t{o.category}\t{'state ok' if o.state_ok else 'STATE CHANGED'}\t{o.detail}"
                for cid, o in outcomes.items()]
        Path(report).write_text("\n".join([line, *rows]) + "\n")
    unclean = sorted(cid for cid, o in outcomes.items() if not o.clean)
    assert unclean == sorted(known), {cid: outcomes[cid].detail for cid in set(unclean) ^ set(known)}
