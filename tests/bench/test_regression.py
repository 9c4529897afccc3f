"""The comparison with the previous results.json (benchmarks.regression): which headwise rows got slower by
more than 2 %, on synthetic results; and that a run reads the previous file before overwriting it."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import main
from benchmarks.regression import compare_with_previous, read_previous, regression_lines
from benchmarks.report import write_results


def _entry(name: str, role: str, t: float) -> dict:
    return {"name": name, "role": role, "median_s": t, "min_s": t, "max_s": t, "rounds": 1, "calls_per_round": 1,
            "max_abs_diff_vs_headwise": None, "matches_headwise": None, "vs": None, "note": ""}


def _groups(hw: dict[str, float], peer: float = 1.0) -> list[dict]:
    return [{"case": "1 forward", "group": group, "threads": 1, "flops": None, "meta": {}, "notes": [],
             "entries": [_entry("headwise", "headwise", t), _entry("packed SDPA (limit)", "limit", peer)]}
            for group, t in hw.items()]


def _results(groups: list[dict], quick: bool = False) -> dict:
    return {"machine": {"quick": quick, "command": "python -m benchmarks", "date_utc": "2000-01-01 00:00 UTC"},
            "groups": groups, "memory": [], "goals": []}


def test_lists_headwise_rows_more_than_two_percent_slower_slowest_first():
    before = _results(_groups({"a": 1.0, "b": 2.0, "c": 4.0, "gone": 1.0}))
    # a: 1.5 % slower (within), b: 3 % slower, c: 10 % slower, "new": not in the previous file; the peer got
    # 50 % slower everywhere, which is no headwise regression.
    now = _groups({"a": 1.015, "b": 2.06, "c": 4.4, "new": 9.0}, peer=1.5)
    cmp = compare_with_previous(before, now, quick=False)
    assert cmp["compared"] == 3 and cmp["new"] == 1 and cmp["skipped"] == ""
    assert [(r["group"], r["entry"]) for r in cmp["slower"]] == [("c", "headwise"), ("b", "headwise")]
    assert [r["ratio"] for r in cmp["slower"]] == pytest.approx([1.1, 1.03])
    assert cmp["slower"][0]["previous_s"] == 4.0 and cmp["slower"][0]["now_s"] == 4.4
    text = "\n".join(regression_lines(cmp))
    assert "only indicative" in text and "paired ratios" in text and "2000-01-01 00:00 UTC" in text
    assert "| 1 forward | c | headwise | 4000.000 | 4400.000 | 1.100 |" in text
    assert "| a |" not in text and "2 of 3 rows compared" in text


def test_faster_or_equal_rows_and_missing_or_other_size_files_are_not_listed():
    before = _results(_groups({"a": 1.0}))
    assert compare_with_previous(before, _groups({"a": 0.5}), quick=False)["slower"] == []
    assert "No headwise row is more than 2 % slower" in "\n".join(
        regression_lines(compare_with_previous(before, _groups({"a": 1.02}), quick=False)))
    none = compare_with_previous(None, _groups({"a": 9.0}), quick=False)
    assert none["slower"] == [] and none["skipped"] == "no previous results.json"
    other = compare_with_previous(_results(_groups({"a": 1.0}), quick=True), _groups({"a": 9.0}), quick=False)
    assert other["slower"] == [] and "other sizes" in other["skipped"]
    assert "Not compared" in "\n".join(regression_lines(other))


def test_written_into_results_and_read_back(tmp_path):
    cmp = compare_with_previous(_results(_groups({"a": 1.0})), _groups({"a": 1.2}), quick=False)
    md, js = write_results(tmp_path, {**_results([])["machine"], "cpu": "x", "logical_cores": 1, "threads": 1,
                                      "torch": "t", "transformers": "t", "python": "p"},
                           _groups({"a": 1.2}), [], [], regression=cmp)
    assert read_previous(js)["regression"]["slower"][0]["ratio"] == pytest.approx(1.2)
    assert "## Against the previous results.json" in md.read_text()
    assert read_previous(tmp_path / "missing.json") is None
    (tmp_path / "bad.json").write_text("{not json")
    assert read_previous(tmp_path / "bad.json") is None


def test_a_run_compares_with_the_file_it_overwrites(tmp_path):
    # A previous quick run whose every time was one picosecond: every headwise row of this run is listed, with
    # its ratio read from the two files (set, not scaled, so that no timing of this machine decides the test).
    assert main(["--quick", "--only", "weights", "--out", str(tmp_path), "--no-tables"]) == 0
    old = json.loads((tmp_path / "results.json").read_text())
    for g in old["groups"]:
        for e in g["entries"]:
            e["median_s"] = 1e-12
    (tmp_path / "results.json").write_text(json.dumps(old))
    assert main(["--quick", "--only", "weights", "--out", str(tmp_path), "--no-tables"]) == 0
    new = json.loads((tmp_path / "results.json").read_text())
    hw_rows = [(g["group"], e["name"]) for g in new["groups"] for e in g["entries"] if e["role"] == "headwise"]
    assert [(r["group"], r["entry"]) for r in new["regression"]["slower"]] and \
        sorted((r["group"], r["entry"]) for r in new["regression"]["slower"]) == sorted(hw_rows)
    now_s = {(g["group"], e["name"]): e["median_s"] for g in new["groups"] for e in g["entries"]}
    for r in new["regression"]["slower"]:
        assert r["previous_s"] == 1e-12 and r["now_s"] == now_s[(r["group"], r["entry"])]
        assert r["ratio"] == pytest.approx(r["now_s"] / 1e-12)


def test_allocator_settings_are_recorded_with_the_run(tmp_path, monkeypatch):
    # A run under pinned glibc thresholds measures something else than one under the defaults: its command
    # (the reproduction line) and RESULTS.md must say so; a run without them says nothing.
    for k in [k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"]:
        monkeypatch.delenv(k)
    assert main(["--quick", "--only", "weights", "--out", str(tmp_path / "plain"), "--no-tables"]) == 0
    plain = json.loads((tmp_path / "plain" / "results.json").read_text())["machine"]
    assert plain["allocator"] == {} and "MALLOC" not in plain["command"]
    assert "Allocator:" not in (tmp_path / "plain" / "RESULTS.md").read_text()
    monkeypatch.setenv("MALLOC_TOP_PAD_", "268435456")
    assert main(["--quick", "--only", "weights", "--out", str(tmp_path / "pinned"), "--no-tables"]) == 0
    pinned = json.loads((tmp_path / "pinned" / "results.json").read_text())["machine"]
    assert pinned["allocator"] == {"MALLOC_TOP_PAD_": "268435456"}
    assert pinned["command"].startswith("MALLOC_TOP_PAD_=268435456 python -m benchmarks --quick")
    assert "Allocator: glibc malloc pinned by `MALLOC_TOP_PAD_=268435456`" in \
        (tmp_path / "pinned" / "RESULTS.md").read_text()
