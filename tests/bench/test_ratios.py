"""The ratio statistic of the benchmarks: the median of per-round ratios, pooled over processes."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.ratios import paired_ratio, process_spread, round_ratios
from benchmarks.suite import merge_processes


def test_a_burst_over_the_same_rounds_cancels():
    # load doubles rounds 2-4 of both entries; a is 10 % slower than b in every round
    b = [[1.0, 2.0, 2.0, 2.0, 1.0, 1.0]]
    a = [[1.1 * t for t in b[0]]]
    assert paired_ratio(a, b) == pytest.approx(1.1)
    assert round_ratios(a, b) == [pytest.approx([1.1] * 6)]


def test_the_median_of_rounds_not_the_ratio_of_medians():
    a, b = [[1.0, 1.0, 3.0, 3.0, 3.0]], [[1.0, 1.0, 1.0, 3.0, 3.0]]
    assert paired_ratio(a, b) == 1.0
    assert statistics.median(a[0]) / statistics.median(b[0]) == 3.0


def test_rounds_pool_over_processes_and_the_spread_is_per_process():
    a = [[1.0, 1.2, 1.1], [2.0, 2.2, 2.6]]
    b = [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]
    # pooled per-round ratios 1.0, 1.2, 1.1, 1.0, 1.1, 1.3 -> median 1.1; process medians 1.1 and 1.1
    assert paired_ratio(a, b) == pytest.approx(1.1)
    assert process_spread(a, b) == pytest.approx((1.1, 1.1))
    assert process_spread(a[:1], b[:1]) is None


@pytest.mark.parametrize("a, b", [([[1.0, 2.0]], [[1.0]]), ([[1.0]], [[1.0], [1.0]]), ([], []), ([[]], [[]])])
def test_unpaired_rounds_are_refused(a, b):
    with pytest.raises(ValueError, match="same rounds"):
        paired_ratio(a, b)


def _run(t: float, ok: bool = True) -> list[dict]:
    return [{"key": "g", "entries": [{"name": "x", "round_s": [[t, t]], "median_s": t, "max_abs_diff": 1e-7 * t,
                                      "matches": ok, "peak_bytes": int(t)}]}]


def test_merged_processes_keep_every_round_and_the_worst_check():
    (g,) = merge_processes([_run(1.0), _run(3.0, ok=False), _run(2.0)])
    (e,) = g["entries"]
    assert e["round_s"] == [[1.0, 1.0], [3.0, 3.0], [2.0, 2.0]]
    assert e["median_s"] == 2.0 and e["matches"] is False and e["max_abs_diff"] == 3e-7 and e["peak_bytes"] == 3


def test_processes_that_measured_different_groups_are_refused():
    other = _run(1.0)
    other[0]["entries"][0]["name"] = "y"
    with pytest.raises(ValueError, match="process 2"):
        merge_processes([_run(1.0), other])
