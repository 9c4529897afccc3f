"""The benchmark suite: headwise against the practical limit and its peers, side by side.

``python -m benchmarks`` (``make bench``) runs every case of issue 5 in one process with a progress bar,
prints a table per comparison and writes ``benchmarks/RESULTS.md`` and ``benchmarks/results.json``.
``--quick`` runs the same machinery on tiny shapes in seconds (results go to a temporary folder unless
``--out`` is given); ``--only forward,decode`` (names or case numbers 1-6) runs a subset.
``--processes 3`` runs the timed cases three times, one after the other, each case in a fresh process, and
reports each ratio as the median of the three paired ratios with their range (see
:mod:`benchmarks.processes`).

Cases: ``forward``/``backward``/``causal`` (1), ``gqa`` (2), ``weights`` (3), ``decode`` (4),
``long`` and ``memory`` (5: a long forward timed, and peak memory with each measurement in its own process),
``peak`` (6, the matmul throughput the forward is held to), all float32 on CPU; ``gpu`` (bfloat16 against
flash-attn and SDPA) only where CUDA is present; ``trace`` (issue 16: capturing every head's residual write,
and the per-head patching sweep on all-MiniLM-L6-v2 against its brute-force loop, :mod:`benchmarks.trace`).
``surgery`` (issue 18: pruned layers' forward and parameters against heads kept, K/V-cache bytes of regrouped
decoders, :mod:`benchmarks.surgery`). ``baseline``: headwise now against headwise at the commit issues 14 and 15
were filed on, both in one process (:mod:`benchmarks.baseline`). Timing via ``torch.utils.benchmark.Timer`` in interleaved
rounds. Each run also lists the headwise rows that got more than 2 % slower than in the ``results.json`` it
overwrites (:mod:`benchmarks.regression`). Run it from the repository root; the ``headwise`` package never
imports it.

Shapes:
    b: batch, s: sequence, d: d_model, h: heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from typing import Callable

from .cases import CASES, FULL, QUICK, Sizes, build
from .notes import MISS_NOTES, PREAMBLE
from .regression import compare_with_previous, read_previous, regression_lines
from .timing import Entry, Group, run_group

__all__ = ["main", "run_suite", "Sizes", "FULL", "QUICK", "Entry", "Group", "run_group", "ORDER", "resolve_only"]

ORDER = ("peak", "forward", "causal", "backward", "gqa", "weights", "decode", "long", "memory", "gpu", "trace", "patched",
         "surgery", "baseline")
#: Threading variables written into a run's recorded command (with the allocator's, report.allocator_env).
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")
_NUMBERS = {"1": ("forward", "causal", "backward"), "2": ("gqa",), "3": ("weights",), "4": ("decode",),
            "5": ("long", "memory"), "6": ("peak", "forward")}


def resolve_only(only: list[str] | None) -> list[str]:
    """Case names to run, in suite order, from ``--only`` values (names or numbers 1-6, comma-separated).

    Example:
        >>> resolve_only(["decode,2"])
        ['gqa', 'decode']
    """
    if not only:
        return list(ORDER)
    wanted: set[str] = set()
    for item in only:
        for part in filter(None, (p.strip() for p in item.split(","))):
            if part in _NUMBERS:
                wanted.update(_NUMBERS[part])
            elif part in ORDER:
                wanted.add(part)
            else:
                raise ValueError(f"--only takes case names {', '.join(ORDER)} or numbers 1-6, got {part!r}")
    return [c for c in ORDER if c in wanted]


class _Progress:
    """A rich progress bar when rich is installed (plain lines otherwise); tables print above it."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled, self.total, self._bar, self._console = enabled, total, None, None
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:  # pragma: no cover - rich is a dev/cli dependency
            return
        self._console = Console()
        self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), console=self._console, transient=False)
        self._task = self._bar.add_task("benchmarks", total=total)

    def __enter__(self) -> "_Progress":
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text[:70])

    def step(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def table(self, title: str, head: list[str], rows: list[list[str]], notes: list[str]) -> None:
        if not self.enabled:
            return
        if self._console is not None:
            from rich.table import Table

            t = Table(title=title, title_justify="left")
            for i, h in enumerate(head):
                t.add_column(h, justify="left" if i == 0 else "right")
            for r in rows:
                t.add_row(*r)
            self._console.print(t)
            for n in notes:
                self._console.print(f"  note: {n}")
            return
        print(f"\n{title}")
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        for r in [head, *rows]:
            print("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
        for n in notes:
            print(f"  note: {n}")

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self._console is not None:
            self._console.print(text)
        else:
            print(text)


def run_suite(sizes: Sizes, cases: list[str], *, hf: bool = True, show: bool = True, tables: bool = True,
              on_group: Callable[[dict], None] | None = None) -> tuple[list[dict], list[dict]]:
    """Run ``cases`` at ``sizes``; return (group results, memory results). Nothing is written."""
    from . import memory as mem
    from .report import TABLE_HEAD, group_table_rows

    factories = []
    for c in cases:
        if c != "memory":
            factories += build(c, sizes, hf=hf) if c in ("forward", "backward", "decode") else build(c, sizes)
    h, d_h, lengths = sizes.memory
    mem_jobs = []
    if "memory" in cases:
        for s in lengths:
            mem_jobs += [("headwise", s), ("headwise one pass", s)]
            if s <= sizes.memory_peers_upto:
                mem_jobs += [("packed SDPA", s), ("eager math", s)]
    results: list[dict] = []
    memory: list[dict] = []
    with _Progress(len(factories) + len(mem_jobs), show) as bar:
        while factories:
            factory = factories.pop(0)
            bar.describe("building inputs")
            group = factory()
            bar.describe(group.name)
            t0 = time.perf_counter()
            res = run_group(group, advance=lambda what: bar.describe(what))
            res["wall_s"] = round(time.perf_counter() - t0, 1)
            del group
            results.append(res)
            if tables:
                bar.table(f"{res['case']} | {res['group']} | {res['threads']} threads", TABLE_HEAD,
                          group_table_rows(res), res["notes"])
            if on_group is not None:
                on_group(res)
            bar.step()
        for impl, s in mem_jobs:
            bar.describe(f"memory {impl} s {s} (own process)")
            t0 = time.perf_counter()
            r = mem.measure(impl, s, h, d_h)
            r["wall_s"] = time.perf_counter() - t0
            memory.append(r)
            got = r.get("error") or f"{r['forward_peak_above_inputs'] / (1 << 30):.3f} GiB above inputs"
            bar.line(f"memory | {impl} s {s} h {h} d_head {d_h}: {got}")
            bar.step()
    return results, memory


def _rerender(path: str, out: str | None, docs: str | None) -> int:
    import json

    from .report import evaluate_goals, write_results, write_summary

    with open(path) as f:
        data = json.load(f)
    goals = evaluate_goals(data["groups"], data["memory"], MISS_NOTES)
    out = out or os.path.dirname(path) or "."
    pre = "" if data["machine"].get("quick") else PREAMBLE
    md, js = write_results(out, data["machine"], data["groups"], data["memory"], goals, pre,
                           regression=data.get("regression"))
    if docs:
        write_summary(docs, data["machine"], goals, data["groups"], data["memory"])
    print(f"rewrote {md} and {js} from {path}")
    return 0


def _run_processes(args: argparse.Namespace, cases: list[str], sizes: Sizes) -> tuple[list[dict], list[dict]]:
    """The timed cases ``args.processes`` times, a fresh process per case (merged), then the memory rows once (each
    of those is already its own process)."""
    from .processes import merge_processes, run_processes
    from .report import TABLE_HEAD, group_table_rows

    passthrough = [flag for flag, on in (("--quick", args.quick), ("--no-hf", args.no_hf),
                                         ("--compile", args.compile)) if on]
    if args.threads:
        passthrough += ["--threads", str(args.threads)]
    timed = [c for c in cases if c != "memory"]
    groups: list[dict] = []
    if timed:
        n = args.processes
        runs = run_processes(timed, n, passthrough,
                             on_start=lambda i: print(f"round {i + 1} of {n}, a process per case: "
                                                      f"{', '.join(timed)}", flush=True),
                             on_done=lambda i, s: print(f"round {i + 1} of {n} done in {s:.0f} s", flush=True))
        groups = merge_processes(runs)
        if not args.no_tables:
            show = _Progress(0, True)
            for g in groups:
                show.table(f"{g['case']} | {g['group']} | {g['threads']} threads x {n} processes",
                           TABLE_HEAD, group_table_rows(g), g["notes"])
    memory: list[dict] = []
    if "memory" in cases:
        _, memory = run_suite(sizes, ["memory"], show=True)
    return groups, memory


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks``."""
    from .report import allocator_env, evaluate_goals, machine_info, write_results

    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, a few seconds (machinery check)")
    p.add_argument("--only", action="append", metavar="CASE",
                   help=f"run only these cases: {', '.join(ORDER)} or numbers 1-6 (comma-separated, repeatable)")
    p.add_argument("--out", metavar="DIR", help="where RESULTS.md and results.json go "
                   "(default: benchmarks/, or a temporary folder with --quick)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face peers")
    p.add_argument("--compile", action="store_true", help="with --quick: also run the torch.compile decode rows")
    p.add_argument("--rerender", metavar="JSON", help="rewrite RESULTS.md (and --docs) from an earlier "
                   "results.json without timing anything (e.g. after the goal notes changed)")
    p.add_argument("--docs", metavar="MD", help="also write the README-ready goal summary to this file")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice; 1 with --quick)")
    p.add_argument("--processes", type=int, default=1, metavar="N",
                   help="run every timed case N times, one after the other, each time in a fresh process of its "
                        "own; each ratio is then the median of the N per-process ratios (their range is shown); "
                        "memory rows run once")
    p.add_argument("--no-tables", action="store_true", help="print no per-group tables (progress and goals only)")
    args = p.parse_args(argv)
    if args.processes < 1:
        p.error(f"--processes takes a count >= 1, got {args.processes}")
    try:
        cases = resolve_only(args.only)
    except ValueError as exc:
        p.error(str(exc))
    if args.rerender:
        return _rerender(args.rerender, args.out, args.docs)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    elif args.quick:
        # Tiny ops on several threads measure thread wake-ups (milliseconds on a busy machine), not the code.
        torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    sizes = QUICK if args.quick else FULL
    if args.quick and args.compile:
        from dataclasses import replace

        sizes = replace(sizes, compile=True)
    out = args.out or (os.path.join(tempfile.gettempdir(), "headwise-bench-quick") if args.quick else "benchmarks")
    command = "python -m benchmarks" + ("" if argv is None and len(sys.argv) <= 1 else " " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)))
    recorded = {k: os.environ[k] for k in THREAD_ENV if k in os.environ} | allocator_env()
    env = " ".join(f"{k}={v}" for k, v in recorded.items())
    command = f"{env} {command}" if env else command
    machine = machine_info(command, args.quick)
    machine["processes"] = args.processes
    t0 = time.perf_counter()
    if args.processes > 1:
        groups, memory = _run_processes(args, cases, sizes)
    else:
        groups, memory = run_suite(sizes, cases, hf=not args.no_hf, tables=not args.no_tables)
    machine["wall_s"] = round(time.perf_counter() - t0, 1)
    goals = evaluate_goals(groups, memory, MISS_NOTES)
    preamble = "" if args.quick else PREAMBLE
    # Read before write_results overwrites it.
    regression = compare_with_previous(read_previous(os.path.join(out, "results.json")), groups, quick=args.quick)
    md, js = write_results(out, machine, groups, memory, goals, preamble, regression=regression)
    if args.docs:
        from .report import write_summary

        write_summary(args.docs, machine, goals, groups, memory)
    print(f"\n{'goal':<75} status")
    for g in goals:
        print(f"{g['goal'][:74]:<75} {g['status']}")
    if regression["previous"] is not None:
        print("\n" + "\n".join(regression_lines(regression)[2:]).rstrip())
    print(f"\nwrote {md} and {js} ({machine['wall_s']} s)")
    return 0
