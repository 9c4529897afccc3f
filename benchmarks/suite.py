"""``python -m benchmarks``: run the cases, print each group's table and the goals, write ``RESULTS.md``.

``--processes N`` runs the whole suite N times, one fresh process after the other; each ratio is then the
median of the per-round ratios over every round of every process, with each process's own ratio range.
``benchmarks/RESULTS.md`` (``RESULTS-cuda.md`` with ``--device cuda``) holds the last whole run: without
``--out``, a ``--quick`` run or a subset (``--only``) writes to a temporary folder instead and says where.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, NoReturn

__all__ = ["CASES", "main", "run_cases", "merge_processes", "resolve_only"]

CASES = ("forward", "backward", "gqa", "decode", "trace", "stats", "sweep", "patched", "families", "surgery")
#: The folder holding the ``benchmarks`` package: child processes run there.
ROOT = Path(__file__).resolve().parent.parent


def resolve_only(only: str | None, cases: tuple[str, ...] = CASES) -> list[str]:
    """Case names to run, in suite order, from a comma-separated ``--only`` value (None: every case); a value
    that names no case, or with an empty name between its commas (a typo, not a wish for fewer cases), is refused.

    Example:
        >>> resolve_only("decode,forward")
        ['forward', 'decode']
    """
    if only is None:
        return list(cases)
    names = [p.strip() for p in only.split(",")]
    wanted = set(names) - {""}
    if not wanted:
        raise ValueError(f"--only takes case names from {', '.join(cases)}, got no name in {only!r}")
    if "" in names:
        raise ValueError(f"--only takes comma-separated case names from {', '.join(cases)}, got an empty name in "
                         f"{only!r}")
    unknown = sorted(wanted - set(cases))
    if unknown:
        raise ValueError(f"--only takes case names from {', '.join(cases)}, got {', '.join(unknown)}")
    return [c for c in cases if c in wanted]


def run_cases(sizes, cases: list[str], *, show: Callable[[dict], None] | None = None) -> list[dict]:  # type: ignore[no-untyped-def]
    """Every group of ``cases`` at ``sizes``, one after the other, in this process."""
    from .cases import layer_groups
    from .hf import hf_groups
    from .surgery import surgery_groups
    from .timing import run_group
    from .sweep import sweep_groups
    from .trace import trace_groups

    factories = {**layer_groups(sizes), **trace_groups(sizes), **sweep_groups(sizes), **hf_groups(sizes),
                 **surgery_groups(sizes)}
    results = []
    for case in cases:
        for factory in factories[case]:
            t0 = time.perf_counter()
            res = run_group(factory())
            res["wall_s"] = round(time.perf_counter() - t0, 1)
            results.append(res)
            if show is not None:
                show(res)
    return results


def _merge_entry(entries: list[dict]) -> dict:
    merged = dict(entries[0])
    merged["round_s"] = [r for e in entries for r in e["round_s"]]
    merged["median_s"] = statistics.median(e["median_s"] for e in entries)
    diffs = [e["max_abs_diff"] for e in entries if e["max_abs_diff"] is not None]
    merged["max_abs_diff"] = max(diffs) if diffs else None
    checks = [e["matches"] for e in entries if e["matches"] is not None]
    merged["matches"] = all(checks) if checks else None
    peaks = [e["peak_bytes"] for e in entries if e.get("peak_bytes") is not None]
    merged["peak_bytes"] = max(peaks) if peaks else None
    return merged


def merge_processes(runs: list[list[dict]]) -> list[dict]:
    """One group list from the group lists of several processes: each entry keeps every process's rounds
    (one list per process), the median of their medians, the largest output difference and peak, and an
    output check that passes only where it passed in every process.

    Example:
        >>> run = lambda t: [{"key": "g", "entries": [{"name": "a", "round_s": [[t]], "median_s": t,
        ...     "max_abs_diff": None, "matches": None}]}]
        >>> merge_processes([run(1.0), run(3.0)])[0]["entries"][0]["round_s"]
        [[1.0], [3.0]]
    """
    first = runs[0]
    for i, run in enumerate(runs[1:], start=2):
        shape = [(g["key"], [e["name"] for e in g["entries"]]) for g in run]
        if shape != [(g["key"], [e["name"] for e in g["entries"]]) for g in first]:
            raise ValueError(f"process {i} measured other groups or entries than process 1: {shape}")
    return [{**g, "entries": [_merge_entry([run[j]["entries"][k] for run in runs]) for k in range(len(g["entries"]))],
             "wall_s": sum(run[j].get("wall_s", 0.0) for run in runs)} for j, g in enumerate(first)]


def _show(res: dict) -> None:
    from .report import group_rows

    rows = [["entry", "median ms", "ratio", "range", "peak MiB", "output", "note"]] + group_rows(res)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"\n{res['title']}  (ratio: time / {res['base']}'s, {res.get('wall_s', 0)} s)", flush=True)
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)), flush=True)
    for n in res["notes"]:
        print(f"  note: {n}")


def _children(argv: list[str], n: int) -> list[list[dict]]:
    runs = []
    with tempfile.TemporaryDirectory(prefix="headwise-bench-") as tmp:
        for i in range(n):
            out = Path(tmp) / f"p{i}.json"
            print(f"process {i + 1} of {n}", flush=True)
            done = subprocess.run([sys.executable, "-m", "benchmarks", *argv, "--json", str(out)],
                                  cwd=ROOT)
            if done.returncode != 0:
                raise SystemExit(f"benchmark process {i + 1} of {n} exited with {done.returncode}")
            runs.append(json.loads(out.read_text()))
    return runs


def _default_out(name: str, kind: str | None) -> Path:
    """Where results go without ``--out``: the recorded file for a whole run, else (``kind``: quick, subset)
    a temporary folder, so that file always holds the last whole run."""
    if kind is None:
        return ROOT / "benchmarks" / name
    return Path(tempfile.gettempdir()) / f"headwise-bench-{kind}" / name


def _main_cuda(args: argparse.Namespace, argv: list[str], cases: list[str], every: int) -> int:
    """``--device cuda``: the CUDA groups of ``cases`` (of ``every`` kinds) in this process, their goals, and
    RESULTS-cuda.md."""
    import torch

    from .cuda import CUDA_GOALS, cuda_groups
    from .report import environment, evaluate, write_results
    from .timing import run_group

    if not torch.cuda.is_available():
        print("--device cuda needs a CUDA device; none is available here", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    groups: list[dict] = []
    command = "python -m benchmarks" + "".join(" " + shlex.quote(a) for a in argv)
    out = args.out or _default_out("RESULTS-cuda.md", None if len(cases) == every else "subset")
    for factory in cuda_groups(cases):
        t0 = time.perf_counter()
        res = run_group(factory())
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        groups.append(res)
        _show(res)
        torch.cuda.empty_cache()
        # written after every group: a run cut short by a time limit keeps what it measured
        goals = evaluate(groups, CUDA_GOALS)
        path = write_results(out, groups, goals, command=command, env=environment(), processes=1, device="cuda")
    _show_goals(goals)
    print(f"\nwrote {path}" + (" (a subset: benchmarks/RESULTS-cuda.md keeps the last whole run)"
                               if len(cases) < every and not args.out else ""))
    return 1 if any(e["matches"] is False for g in groups for e in g["entries"]) else 0


def _show_goals(goals: list[dict], checks: list[dict] | None = None) -> None:
    print(f"\n{'goal':<66} {'target':<8} {'ratio':<7} status")
    for g in goals:
        ratio = "" if g["ratio"] is None else f"{g['ratio']:.3f}"
        print(f"{g['goal']:<66} {g['target']:<8} {ratio:<7} {g['status']}")
    if checks:
        from .report import check_rows

        rows = [["check (exact)", "entry", "K/V cache bytes", "must be", "status"]] + check_rows(checks)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        print()
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _count(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number >= 1, got {n}")
    return n


def _check_out(out: str | None) -> str | None:
    """Why ``--out`` cannot be written as a file (checked before a run of minutes, not after it), or None."""
    if out is None:
        return None
    path = Path(out)
    if path.is_dir():
        return f"--out takes a file path, got the directory {out}"
    above = next((a for a in path.absolute().parents if a.exists()), None)
    if above is not None and not above.is_dir():
        return f"--out needs a folder to write into, got {out} (under the file {above})"
    return None


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line (the usage itself stays in --help), as the headwise CLI's."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"benchmarks: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks``."""
    p = _Parser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, under a minute (a check of the machinery)")
    p.add_argument("--only", metavar="CASES", help=f"comma-separated cases: {', '.join(CASES)}")
    p.add_argument("--processes", type=_count, default=1, metavar="N", help="run the suite N times, each in a "
                   "fresh process; ratios pool every round of every process")
    p.add_argument("--threads", type=_count, metavar="N", help="torch intra-op threads (default: torch's choice; "
                   "1 with --quick)")
    p.add_argument("--out", metavar="MD", help="where RESULTS.md goes (default benchmarks/RESULTS.md for a whole "
                   "run; a temporary folder with --quick or --only naming fewer than every case)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the GPU groups "
                   "(benchmarks/cuda.py: bfloat16, written to benchmarks/RESULTS-cuda.md), one process at the GPU "
                   "sizes, so not with --quick, --processes or --threads; --only then takes forward, backward, "
                   "decode, compiled, patched, statistics")
    p.add_argument("--json", metavar="PATH", help=argparse.SUPPRESS)  # a child process's results
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    bad_out = _check_out(args.out)
    if bad_out:
        p.error(bad_out)
    if args.device == "cuda":
        from .cuda import CUDA_CASES

        cpu_only = [f for f, on in (("--quick", args.quick), ("--processes", args.processes != 1),
                                    ("--threads", args.threads is not None)) if on]
        if cpu_only:
            p.error(f"--device cuda runs one process at the GPU sizes; it takes no {', '.join(cpu_only)}")
        try:
            cuda_cases = resolve_only(args.only, CUDA_CASES)
        except ValueError as exc:
            p.error(f"{exc} (--device cuda)")
        return _main_cuda(args, argv, cuda_cases, len(CUDA_CASES))
    try:
        cases = resolve_only(args.only)
    except ValueError as exc:
        p.error(str(exc))
    import torch

    from .cases import FULL, QUICK
    from .report import environment, evaluate, held_checks, write_results

    if args.threads or args.quick:
        torch.set_num_threads(args.threads or 1)  # tiny ops on many threads time thread wake-ups
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.processes > 1:
        child = (["--quick"] if args.quick else []) + (["--only", args.only] if args.only is not None else []) + (
            ["--threads", str(args.threads)] if args.threads else [])
        groups = merge_processes(_children(child, args.processes))
        for g in groups:
            _show(g)
    else:
        show = (lambda r: print(f"  {r['title']}: {r['wall_s']} s", flush=True)) if args.json else _show
        groups = run_cases(QUICK if args.quick else FULL, cases, show=show)
    if args.json:
        Path(args.json).write_text(json.dumps(groups))
        return 0
    goals = evaluate(groups)
    env = environment()
    command = " ".join(f"{k}={v}" for k, v in env.items() if k.isupper() and v != "unset")
    command += " python -m benchmarks" + "".join(" " + shlex.quote(a) for a in argv)
    subset = len(cases) < len(CASES)
    default = _default_out("RESULTS.md", "quick" if args.quick else "subset" if subset else None)
    path = write_results(args.out or default, groups, goals, command=command.strip(), env=env,
                         processes=args.processes, quick=args.quick)
    checks = held_checks(groups)
    _show_goals(goals, checks)
    print(f"\nwrote {path}" + (" (quick: tiny shapes, the ratios say nothing about the goals)" if args.quick else
                               " (a subset: benchmarks/RESULTS.md keeps the last whole run)" if subset and
                               not args.out else ""))
    different = [f"{g['title']}: {e['name']}" for g in groups for e in g["entries"] if e["matches"] is False]
    if different:  # a peer that computes something else makes the run no measurement
        print("outputs differ from the reference entry: " + "; ".join(different), file=sys.stderr)
    failed = [f"{c['group']}: {c['entry']}" for c in checks if not c["holds"]]
    if failed:
        print("K/V cache bytes are not n_kv_heads / n_heads of the MHA cache's: " + "; ".join(failed),
              file=sys.stderr)
    return 1 if different or failed else 0
