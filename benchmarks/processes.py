"""``--processes N``: the timed cases run in N fresh processes, and each ratio is the median of N paired ratios.

Why: on a shared virtual machine the rounds within one process agree closely, but two processes measuring
the same comparison can differ by several per cent (how the allocator and the page cache serve that
process, which core it lands on; docs/benchmarks.md has the measurements). A parity goal read from a single
process is then a coin toss between runs. Each process still measures headwise and its peers side by side,
interleaved, on identical inputs; only the summary changes: per comparison, the median over processes of
that process's ``headwise / peer`` ratio (paired, never a ratio of medians taken in different processes),
with the per-process range shown next to it.

Each case also gets its own fresh process in every round: a case's timings must not depend on the heap that
earlier cases left behind.

Shapes:
    none: this module handles result dictionaries, not tensors.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

__all__ = ["merge_processes", "run_processes", "ROOT"]

#: The folder that holds the ``benchmarks`` package: children run there, so ``-m benchmarks`` finds it.
ROOT = Path(__file__).resolve().parent.parent


def run_processes(cases: list[str], n: int, passthrough: list[str], *,
                  on_start: Callable[[int], None] | None = None,
                  on_done: Callable[[int, float], None] | None = None) -> list[list[dict]]:
    """Run the cases ``n`` times, one after the other; every round runs each case in its own fresh process
    (``python -m benchmarks --only <case>``). Returns each round's group results, in case order (the
    ``groups`` of the children's ``results.json``).

    ``passthrough`` are flags every child gets (``--quick``, ``--threads 2``, ...). A child that fails
    raises ``RuntimeError`` with its exit status: a merged result must never silently hold fewer
    processes than asked for.
    """
    if n < 1:
        raise ValueError(f"--processes takes a count >= 1, got {n}")
    runs: list[list[dict]] = []
    with tempfile.TemporaryDirectory(prefix="headwise-bench-proc-") as tmp:
        for i in range(n):
            if on_start is not None:
                on_start(i)
            t0 = time.perf_counter()
            groups: list[dict] = []
            for case in cases:
                out = Path(tmp) / f"p{i}" / case
                cmd = [sys.executable, "-m", "benchmarks", "--only", case, "--out", str(out), "--no-tables",
                       *passthrough]
                # The child's progress bar and goal lines go straight to this terminal (its tables are off).
                done = subprocess.run(cmd, cwd=ROOT)
                if done.returncode != 0:
                    raise RuntimeError(f"benchmark process {i + 1} of {n} ({case}) exited with {done.returncode} "
                                       f"(its output is above): {' '.join(cmd)}")
                groups += json.loads((out / "results.json").read_text())["groups"]
            runs.append(groups)
            if on_done is not None:
                on_done(i, time.perf_counter() - t0)
    return runs


def _merge_entry(entries: list[dict]) -> dict:
    merged = dict(entries[0])
    medians = [e["median_s"] for e in entries]
    merged.update(
        median_s=statistics.median(medians), min_s=min(e["min_s"] for e in entries),
        max_s=max(e["max_s"] for e in entries), rounds=sum(e["rounds"] for e in entries),
        per_process_median_s=medians, per_process_min_s=[e["min_s"] for e in entries],
    )
    merged.pop("round_s", None)
    if all(e.get("round_s") for e in entries):  # the rounds of each process, for per-round ratios
        merged["per_process_round_s"] = [e["round_s"] for e in entries]
    diffs = [e["max_abs_diff_vs_headwise"] for e in entries]
    if all(d is not None for d in diffs):
        merged["max_abs_diff_vs_headwise"] = max(diffs)
    checks = [e["matches_headwise"] for e in entries]
    if all(c is not None for c in checks):
        merged["matches_headwise"] = all(checks)
    if "compiled_graphs_so_far" in merged:  # the goal is "one graph": report the worst process
        merged["compiled_graphs_so_far"] = max(e["compiled_graphs_so_far"] for e in entries)
    return merged


def merge_processes(runs: list[list[dict]]) -> list[dict]:
    """One group list from the group lists of several processes (same cases, same entries, in the same order).

    Each entry keeps every process's median (``per_process_median_s``) and rounds (``per_process_round_s``)
    for paired ratios (:mod:`benchmarks.ratios`); its ``median_s`` is the median of those medians,
    ``min_s``/``max_s`` span every round of every process, output differences take the largest and
    compiled-graph counts the worst process. Groups that do not match across
    processes raise ``ValueError`` naming the difference.

    Example:
        >>> run = lambda t: [{"case": "c", "group": "g", "entries": [{"name": "headwise", "median_s": t,
        ...     "min_s": t, "max_s": t, "rounds": 1, "max_abs_diff_vs_headwise": None, "matches_headwise": None}]}]
        >>> merged = merge_processes([run(1.0), run(3.0), run(2.0)])
        >>> merged[0]["processes"], merged[0]["entries"][0]["median_s"], merged[0]["entries"][0]["rounds"]
        (3, 2.0, 3)
    """
    if not runs:
        raise ValueError("merge_processes needs at least one process's results, got none")
    first = runs[0]
    keys = [(g["case"], g["group"]) for g in first]
    merged = []
    for i, run in enumerate(runs[1:], start=2):
        got = [(g["case"], g["group"]) for g in run]
        if got != keys:
            raise ValueError(f"process {i} measured groups {got}, expected the first process's {keys}")
    for j, g in enumerate(first):
        per = [run[j] for run in runs]
        names = [e["name"] for e in g["entries"]]
        for i, other in enumerate(per[1:], start=2):
            if [e["name"] for e in other["entries"]] != names:
                raise ValueError(f"group {g['group']!r}: process {i} has entries "
                                 f"{[e['name'] for e in other['entries']]}, expected {names}")
        entries = [_merge_entry([p["entries"][k] for p in per]) for k in range(len(names))]
        merged.append({**g, "entries": entries, "processes": len(runs),
                       "wall_s": sum(p.get("wall_s", 0.0) for p in per)})
    return merged
