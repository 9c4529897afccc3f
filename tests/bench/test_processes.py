"""``--processes N``: merging several processes' results, and paired ratios (the median of per-process
ratios, never a ratio of medians from different processes). No timing assertion: the numbers are synthetic,
or (end to end) only their structure is checked."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import pytest

from benchmarks import main
from benchmarks.processes import merge_processes
from benchmarks.report import evaluate_goals, group_table_rows, paired_ratio, ratio_rows

pytestmark = pytest.mark.xdist_group("bench")  # the end-to-end test spawns benchmark processes

HW, PEER = "headwise return_weights=True", "nn.MHA need_weights, per head"


def _entry(name: str, role: str, t: float, **kw) -> dict:
    return {"name": name, "role": role, "median_s": t, "min_s": 0.9 * t, "max_s": 1.1 * t, "rounds": 5,
            "calls_per_round": 1, "max_abs_diff_vs_headwise": kw.pop("diff", None),
            "matches_headwise": kw.pop("ok", None), "vs": None, "note": "", **kw}


def _run(hw: float, peer: float, diff: float = 1e-7, ok: bool = True, graphs: int | None = None) -> list[dict]:
    extra = {} if graphs is None else {"compiled_graphs_so_far": graphs}
    return [{"case": "3 per-head weights", "group": "weights b8 s512 d768 h12", "threads": 2, "flops": None,
             "meta": {}, "notes": [], "wall_s": 1.0,
             "entries": [_entry(HW, "headwise", hw, **extra), _entry(PEER, "peer", peer, diff=diff, ok=ok)]}]


def test_merge_keeps_every_process_and_pairs_ratios():
    # per-process ratios 0.5, 1.5, 1.25: paired median 1.25; the ratio of the medians (3 / 2) would say 1.5
    merged = merge_processes([_run(1.0, 2.0), _run(3.0, 2.0, diff=3e-7), _run(5.0, 4.0, ok=False)])
    (g,) = merged
    assert g["processes"] == 3 and g["wall_s"] == 3.0
    hw, peer = g["entries"]
    assert hw["per_process_median_s"] == [1.0, 3.0, 5.0] and peer["per_process_median_s"] == [2.0, 2.0, 4.0]
    assert hw["median_s"] == 3.0 and hw["min_s"] == pytest.approx(0.9) and hw["max_s"] == pytest.approx(5.5)
    assert hw["rounds"] == 15
    assert peer["max_abs_diff_vs_headwise"] == 3e-7 and peer["matches_headwise"] is False  # worst process wins
    assert paired_ratio(hw, peer) == pytest.approx(statistics.median([0.5, 1.5, 1.25]))
    assert hw["median_s"] / peer["median_s"] == pytest.approx(1.5)  # what pairing avoids
    (row,) = ratio_rows(g)
    assert row["ratio"] == pytest.approx(1.25) and row["per_process"] == pytest.approx((0.5, 1.5))
    assert group_table_rows(g)[1][4] == "1.250 (0.500-1.500)"


def test_goal_reads_the_paired_median_and_shows_the_range():
    merged = merge_processes([_run(1.0, 2.0), _run(3.0, 2.0), _run(5.0, 4.0)])
    goal = next(x for x in evaluate_goals(merged, []) if x["goal"].startswith("per-head weights"))
    assert goal["met"] is False and goal["measured"].startswith("worst 1.250 (per process 0.500-1.500")
    met = merge_processes([_run(0.9, 1.0), _run(1.2, 1.0), _run(0.95, 1.0)])
    goal = next(x for x in evaluate_goals(met, []) if x["goal"].startswith("per-head weights"))
    assert goal["met"] is True and "per process 0.900-1.200" in goal["detail"]


def test_rounds_are_paired_across_processes_when_kept():
    # Process 2's second and third rounds ran under a burst that hit both entries of those rounds: its medians
    # say headwise is 2x slower there (ratio of medians 2.0), its rounds say 1.0 wherever both were measured alike.
    def run(hw_rounds: list[float], peer_rounds: list[float]) -> list[dict]:
        (g,) = _run(statistics.median(hw_rounds), statistics.median(peer_rounds))
        g["entries"][0]["round_s"], g["entries"][1]["round_s"] = hw_rounds, peer_rounds
        return [g]

    merged = merge_processes([run([1.0, 1.0, 1.0], [1.0, 1.0, 1.0]), run([1.0, 4.0, 4.0], [2.0, 4.0, 4.0]),
                              run([1.1, 1.1, 1.1], [1.0, 1.0, 1.0])])
    (g,) = merged
    hw, peer = g["entries"]
    assert "round_s" not in hw and hw["per_process_round_s"] == [[1.0, 1.0, 1.0], [1.0, 4.0, 4.0], [1.1, 1.1, 1.1]]
    assert hw["per_process_median_s"][1] / peer["per_process_median_s"][1] == 1.0  # medians 4.0 and 4.0
    # per-round ratios: 1, 1, 1 | 0.5, 1, 1 | 1.1, 1.1, 1.1 -> median 1.0; per process 1.0, 1.0, 1.1
    assert paired_ratio(hw, peer) == pytest.approx(1.0)
    assert ratio_rows(g)[0]["per_process"] == pytest.approx((1.0, 1.1))
    # an entry without the rounds of every process falls back to the per-process medians
    del peer["per_process_round_s"]
    assert paired_ratio(hw, peer) == pytest.approx(statistics.median([1.0, 1.0, 1.1]))


def test_single_process_results_are_unchanged():
    (g,) = _run(3.0, 2.0)
    hw, peer = g["entries"]
    assert paired_ratio(hw, peer) == 1.5 and group_table_rows(g)[1][4] == "1.500"
    assert ratio_rows(g)[0]["per_process"] is None


def test_compiled_graphs_report_the_worst_process():
    merged = merge_processes([_run(1.0, 1.0, graphs=1), _run(1.0, 1.0, graphs=2)])
    assert merged[0]["entries"][0]["compiled_graphs_so_far"] == 2


def test_mismatched_processes_raise():
    with pytest.raises(ValueError, match="at least one"):
        merge_processes([])
    other = _run(1.0, 1.0)
    other[0]["group"] = "weights b4 s128 d4096 h32"
    with pytest.raises(ValueError, match="process 2 measured groups"):
        merge_processes([_run(1.0, 1.0), other])
    fewer = _run(1.0, 1.0)
    fewer[0]["entries"].pop()
    with pytest.raises(ValueError, match="process 2 has entries"):
        merge_processes([_run(1.0, 1.0), fewer])


def test_processes_end_to_end(tmp_path, monkeypatch):
    # Two real child processes on tiny shapes: the merged file holds both processes' medians per entry. Run
    # from another folder: the children must still find the benchmarks package.
    monkeypatch.chdir(tmp_path)
    assert main(["--quick", "--processes", "2", "--only", "weights", "--out", str(tmp_path), "--no-tables"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["machine"]["processes"] == 2
    assert data["groups"] and all(g["processes"] == 2 for g in data["groups"])
    for g in data["groups"]:
        for e in g["entries"]:
            assert len(e["per_process_median_s"]) == 2 and all(t > 0 for t in e["per_process_median_s"])
            assert e["median_s"] == pytest.approx(statistics.median(e["per_process_median_s"]))
            if e["max_abs_diff_vs_headwise"] is not None:
                assert e["matches_headwise"], e
    assert "ran 2 times, one after the other, each time in a fresh process" in (tmp_path / "RESULTS.md").read_text()


def test_every_case_gets_its_own_process(monkeypatch, tmp_path):
    # A case's timings must not depend on the heap earlier cases left behind: one child per case and round.
    import benchmarks.processes as proc

    calls = []

    def fake_run(cmd, **kw):
        case, out = cmd[cmd.index("--only") + 1], Path(cmd[cmd.index("--out") + 1])
        calls.append(case)
        out.mkdir(parents=True)
        (out / "results.json").write_text(json.dumps({"groups": [{"case": case, "group": case, "entries": []}]}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(proc.subprocess, "run", fake_run)
    runs = proc.run_processes(["forward", "decode"], 2, ["--quick"])
    assert calls == ["forward", "decode", "forward", "decode"]
    assert [[g["case"] for g in run] for run in runs] == [["forward", "decode"]] * 2


def test_processes_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main(["--quick", "--processes", "0"])
    assert "--processes takes a count >= 1, got 0" in capsys.readouterr().err


def test_a_failing_process_stops_the_run():
    # A merged result must never silently hold fewer processes than asked for.
    from benchmarks.processes import run_processes

    with pytest.raises(RuntimeError, match=r"benchmark process 1 of 2 \(weights\) exited with 2"):
        run_processes(["weights"], 2, ["--quick", "--threads", "not-a-number"])
    with pytest.raises(ValueError, match="--processes takes a count >= 1, got 0"):
        run_processes(["weights"], 0, [])
