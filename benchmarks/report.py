"""The goals, the checks, and ``RESULTS.md``: every goal is a ratio of two entries of one group, measured in
the same run; every check is exact (bytes a call leaves held, counted, not timed).

A ratio is the median of the per-round ratios (:func:`benchmarks.ratios.paired_ratio`); below 1 means the
first entry is faster.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from .hf import FAMILIES
from .ratios import paired_ratio, process_spread

__all__ = ["Goal", "GOALS", "ENV_VARS", "evaluate", "held_checks", "check_rows", "environment", "write_results",
           "group_rows"]

#: The environment every side of every comparison shares, recorded in RESULTS.md.
ENV_VARS = ("THP_MEM_ALLOC_ENABLE", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class Goal:
    """``entry`` against each of ``others`` in group ``key`` (or in each group of a tuple of keys): the worst
    paired ratio must be <= ``target``; with ``metric="peak"`` the ratio of their peak memory (memory groups)."""

    label: str
    key: str | tuple[str, ...]
    entry: str
    others: tuple[str, ...]
    target: float
    metric: str = "time"


_HW, _PATCHED = "headwise", "headwise (patched)"
_FAMILIES = tuple(name for name, *_ in FAMILIES.values())
GOALS = (
    Goal("forward vs packed SDPA", "forward", _HW, ("packed SDPA",), 1.03),
    Goal("forward vs nn.MultiheadAttention fast path", "forward", _HW, ("nn.MultiheadAttention fast path",), 0.90),
    Goal("causal forward vs packed SDPA", "forward causal", _HW, ("packed SDPA",), 1.03),
    Goal("causal forward vs nn.MultiheadAttention fast path", "forward causal", _HW,
         ("nn.MultiheadAttention fast path",), 0.90),
    Goal("fwd+bwd vs packed SDPA", "fwd+bwd", _HW, ("packed SDPA",), 1.05),
    Goal("GQA forward vs packed SDPA enable_gqa", "gqa", _HW, ("packed SDPA enable_gqa",), 1.03),
    Goal("GQA forward vs repeated K/V", "gqa", _HW, ("packed SDPA repeat K/V",), 1.00),
    Goal("decode vs the x @ W preallocated loop", "decode", _HW, ("x @ W preallocated loop",), 1.05),
    Goal("d64 decode step vs the x @ W preallocated loop", "decode step", "headwise DecodeStep",
         ("x @ W preallocated loop",), 1.25),
    Goal("every head's result vs a plain forward", "trace result", "headwise trace", ("plain forward",), 1.10),
    Goal("every head's result vs every peer's capture", "trace result", "headwise trace",
         ("hooks + einsum", "TransformerLens run_with_cache", "TransformerLens run_with_hooks", "nnsight", "pyvene"),
         1.00),
    Goal("pattern+z vs a plain forward", "trace pattern+z", "headwise trace", ("plain forward",), 1.10),
    Goal("all four statistics at s8192 vs a plain forward", "trace statistics", "headwise trace, all four statistics",
         ("plain forward",), 2.00),
    Goal("their peak memory vs a plain forward's", "trace statistics", "headwise trace, all four statistics",
         ("plain forward",), 1.30, metric="peak"),
    Goal("144-head sweep vs every peer's batched sweep", "sweep", "headwise head_effects",
         ("hooks, a batch per layer", "TransformerLens run_with_hooks", "nnsight", "pyvene"), 1.00),
    Goal("patched BERT forward vs unpatched", "patched BERT forward", _PATCHED, ("HF BERT (unpatched)",), 1.02),
    Goal("patched Llama forward vs unpatched", "patched Llama forward", _PATCHED, ("HF Llama (unpatched)",), 1.02),
    Goal("patched Llama generate vs unpatched", "patched Llama generate", _PATCHED, ("HF Llama (unpatched)",), 1.02),
    Goal("patched forward vs unpatched, every family", tuple(f"patched {n} forward" for n in _FAMILIES), _PATCHED,
         tuple(f"HF {n} (unpatched)" for n in _FAMILIES), 1.02),
    Goal("patched generate vs unpatched, every family", tuple(f"patched {n} generate" for n in _FAMILIES), _PATCHED,
         tuple(f"HF {n} (unpatched)" for n in _FAMILIES), 1.02),
    Goal("surgery: forward with half the heads removed vs unpruned", "surgery prune", "headwise, half the heads",
         ("headwise, every head",), 0.60),
)


def _entry(group: dict, name: str) -> dict | None:
    return next((e for e in group["entries"] if e["name"] == name), None)


def evaluate(groups: list[dict], goals: tuple[Goal, ...] = GOALS) -> list[dict]:
    """Each goal's worst ratio in ``groups``, its per-process range and its status: met, missed, not run
    (its groups or entries are absent) or output mismatch (an entry it compares failed the output check).
    A goal over several groups names those where it could not run."""
    by_key = {g["key"]: g for g in groups}
    out = []
    for goal in goals:
        keys = (goal.key,) if isinstance(goal.key, str) else goal.key
        pairs, absent = [], []
        for key in keys:
            group = by_key.get(key)
            mine = _entry(group, goal.entry) if group else None
            others = [e for e in (_entry(group, n) for n in goal.others) if e] if mine else []
            pairs += [(mine, o) for o in others]
            if not others:
                absent.append(key)
        row = {"goal": goal.label, "target": f"<= {goal.target:.2f}", "ratio": None, "spread": None,
               "vs": None, "status": "not run"}
        ratio = None
        if pairs and goal.metric == "peak":  # peak memory above the level before the call, of one call each
            peaks = [(a["peak_bytes"] / b["peak_bytes"], b) for a, b in pairs
                     if a.get("peak_bytes") and b.get("peak_bytes")]
            if peaks:
                ratio, worst = max(peaks, key=lambda r: r[0])
                row.update(ratio=ratio, vs=worst["name"])
        elif pairs:
            ratio, mine, worst = max(((paired_ratio(a["round_s"], b["round_s"]), a, b) for a, b in pairs),
                                     key=lambda r: r[0])
            row.update(ratio=ratio, spread=process_spread(mine["round_s"], worst["round_s"]), vs=worst["name"])
        if ratio is not None:
            if any(e.get("matches") is False for pair in pairs for e in pair):
                row["status"] = "output mismatch"
            else:
                # a goal is an upper bound, so a miss is always by a positive amount
                row["status"] = "met" if ratio <= goal.target else f"missed by {100 * (ratio / goal.target - 1):.1f} %"
            if absent and len(keys) > 1:
                row["status"] += f" (not run: {', '.join(absent)})"
        out.append(row)
    return out


def held_checks(groups: list[dict]) -> list[dict]:
    """The exact checks of the groups whose entries record what they leave held (``Entry.held``: a K/V cache's
    bytes and its K/V heads): each such entry's bytes must be ``units / top`` of the bytes of the entry holding
    the most units (``top`` of them: the MHA cache), to the byte.

    Counted, not timed, so no spread applies: a check that fails is a fault of what the entry measures (a
    surgery that left the wrong cache), and the run says so.

    Args:
        groups: the groups of a run, as :func:`benchmarks.timing.run_group` returns them.

    Returns:
        One row per entry that holds bytes: ``group``, ``entry``, ``bytes``, ``units``, ``of`` (the reference
        entry), ``expected`` (its bytes times ``units / top``) and ``holds``.
    """
    rows = []
    for g in groups:
        held = [e for e in g["entries"] if e.get("held")]
        if not held:
            continue
        top = max(held, key=lambda e: e["held"][1])
        top_bytes, top_units = top["held"]
        for e in held:
            nbytes, units = e["held"]
            rows.append({"group": g["key"], "entry": e["name"], "bytes": nbytes, "units": f"{units}/{top_units}",
                         "of": top["name"], "expected": top_bytes * units / top_units,
                         "holds": nbytes * top_units == top_bytes * units})
    return rows


def check_rows(checks: list[dict]) -> list[list[str]]:
    """Table rows of :func:`held_checks`' rows: group, entry, bytes held, the share of the reference it must be,
    status."""
    return [[c["group"], c["entry"], f"{c['bytes']:,}", f"{c['units']} of `{c['of']}`'s",
             "holds" if c["holds"] else f"FAILS: {c['expected']:,.0f} expected"] for c in checks]


def environment() -> dict[str, str]:
    """The shared settings of a run: the variables of :data:`ENV_VARS` and torch's intra-op threads."""
    import torch

    env = {k: os.environ.get(k, "unset") for k in ENV_VARS}
    env["torch threads"] = str(torch.get_num_threads())
    return env


def _machine() -> dict[str, str]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = "not installed"
    return {"cpu": f"{cpu}, {os.cpu_count()} logical cores", "torch": torch.__version__, "transformers": tf,
            "python": platform.python_version()}


def _range(spread: tuple[float, float] | None) -> str:
    return "" if spread is None else f"{spread[0]:.3f}-{spread[1]:.3f}"


def group_rows(group: dict) -> list[list[str]]:
    """Table rows of one group: entry, median ms per call, paired ratio to the group's base entry and its
    per-process range, peak memory above the base's (memory groups), output check, note."""
    base = _entry(group, group["base"])
    rows = []
    for e in group["entries"]:
        ratio = paired_ratio(e["round_s"], base["round_s"])
        peak = ""
        if e.get("peak_bytes") is not None and base.get("peak_bytes") is not None:
            peak = f"{(e['peak_bytes'] - base['peak_bytes']) / (1 << 20):+.1f}"
        check = "" if e["matches"] is None else (
            f"{'equal' if e['matches'] else 'DIFFERENT'} ({e['max_abs_diff']:.1e} vs {e['checked_against']})")
        rows.append([e["name"], f"{1e3 * e['median_s']:.3f}", f"{ratio:.3f}",
                     _range(process_spread(e["round_s"], base["round_s"])), peak, check, e["note"]])
    return rows


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    keep = [i for i in range(len(head)) if any(r[i] for r in rows)]  # columns with something in them
    head, rows = [head[i] for i in keep], [[r[i] for i in keep] for r in rows]
    return ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def write_results(path: str | Path, groups: list[dict], goals: list[dict], *, command: str, env: dict[str, str],
                  processes: int, quick: bool = False, device: str = "cpu") -> Path:
    """Write ``RESULTS.md`` (the goals, then one table per group) to ``path``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rounds = sorted({len(e["round_s"][0]) for g in groups for e in g["entries"]})
    lines = ["# Benchmark results", "",
             f"Written by `{command}` on {date}; the run rewrites this file. Ratios are medians of per-round "
             "ratios of entries timed interleaved on the same inputs (docs/benchmarks.md).", ""]
    if quick:
        lines += ["A quick run: tiny shapes check the machinery; its ratios say nothing about the goals.", ""]
    settings = {**_machine(), **env, "processes": str(processes),
                "rounds per group and process": ", ".join(map(str, rounds)), "dtype": "float32, CPU"}
    if device == "cuda":
        import torch

        settings.update(gpu=torch.cuda.get_device_name(), cuda=str(torch.version.cuda),
                        cudnn=str(torch.backends.cudnn.version()), dtype="bfloat16, CUDA")
    lines += _table(["setting", "value"], [[k, v] for k, v in settings.items()])
    lines += ["", "## Goals", ""]
    lines += _table(["goal", "target", "ratio", "per-process range", "worst against", "status"],
                    [[g["goal"], g["target"], "" if g["ratio"] is None else f"{g['ratio']:.3f}",
                      _range(g["spread"]), g["vs"] or "", g["status"]] for g in goals])
    checks = held_checks(groups)
    if checks:
        lines += ["", "## Checks", "", "Exact, counted, not timed: the K/V cache bytes a cached prefill leaves, "
                  "against n_kv_heads / n_heads of the MHA cache's.", ""]
        lines += _table(["group", "entry", "K/V cache bytes", "must be", "status"], check_rows(checks))
    for g in groups:
        lines += ["", f"## {g['title']}", "",
                  f"Ratios: time / `{g['base']}`'s time, paired per round; {g['threads']} torch threads."]
        if any(e.get("peak_bytes") is not None for e in g["entries"]):
            what = "CUDA memory (max_memory_allocated)" if device == "cuda" else "resident memory"
            lines[-1] += f" Peak: MiB of {what} one call needs above `{g['base']}`'s."
        lines += [""] + _table(["entry", "median ms", "ratio", "per-process range", "peak MiB", "output",
                                "note"], group_rows(g))
        if g["notes"]:
            lines += [""] + [f"- {n}" for n in g["notes"]]
    path.write_text("\n".join(lines) + "\n")
    return path

