"""The trace case's machinery on tiny shapes: its groups, that the sweep and the brute-force loop agree,
that the traced forward returns what the plain one does, and its goal rows. Never a timing assertion."""

from __future__ import annotations

import pytest

from benchmarks import resolve_only
from benchmarks.report import evaluate_goals
from benchmarks.trace import measure_memory
from tests.bench.tiny import run_tiny

pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("bench")  # the memory rows spawn processes


@pytest.fixture(scope="module")
def groups() -> list[dict]:
    return run_tiny("trace")


def test_trace_case_groups_and_outputs_agree(groups):
    assert resolve_only(["trace"]) == ["trace"]
    assert [g["group"] for g in groups] == ["trace result b2 s32 d64 h4", "trace sweep tiny random BERT 2x4"]
    for g in groups:
        compared = [e for e in g["entries"] if e["max_abs_diff_vs_headwise"] is not None]
        assert compared and all(e["matches_headwise"] for e in compared), g["group"]
    memory = groups[0]["meta"]["memory"]
    assert set(memory) == {"plain", "traced"} and all("error" not in m for m in memory.values())
    assert groups[0]["meta"]["result_bytes"] == 2 * 32 * 4 * 64 * 4


def test_trace_goal_rows(groups):
    rows = {g["goal"]: g for g in evaluate_goals(groups, [])}
    assert rows["trace: capture every head's result vs a plain forward"]["target"] == "<= 1.5"
    assert rows["trace: per-head patching sweep vs the brute-force loop"]["status"] != "not measured"
    mem = [r for name, r in rows.items() if name.startswith("trace: memory")]
    assert len(mem) == 1 and "MiB extra" in mem[0]["measured"]


def test_memory_child_reports_an_error_instead_of_raising():
    assert "error" in measure_memory("traced", 1, 4, 6, 4)  # 6 is not divisible by 4 heads
