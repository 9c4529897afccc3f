"""Interleaved timing: every entry of a group runs on the same inputs, round after round, in rotating order,
so slow drift of a shared machine (other processes, clocks, thermals) lands on every entry alike.

Each round times one block of ``number`` calls per entry with ``torch.utils.benchmark.Timer`` (which also
pins the thread count); the statistics are over rounds: median, min, max, and every round's time is kept
(``round_s``) so that two entries can be compared round by round (:mod:`benchmarks.ratios`).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.benchmark import Timer

from headwise.buffers import fresh_empty, huge_pages_advised

__all__ = ["Entry", "Group", "run_group", "ticks", "refresh_memory", "forward_flops"]


@dataclass
class Entry:
    """One implementation in a comparison.

    ``fn`` is the timed call; its return value (the first call's) is compared with the headwise entry's
    when the group has a tolerance. ``reset`` (untimed) runs before the warm-up and before every round
    (decoding rewinds its cache there). ``number`` fixes the calls per block (else calibrated).
    """

    name: str
    fn: Callable[[], Any]
    role: str = "peer"  # "headwise", "limit" (the practical limit) or "peer"
    reset: Callable[[], None] | None = None
    number: int | None = None
    note: str = ""
    compare: bool = True
    ref: str | None = None  # the headwise entry this one is compared with (default: the role "headwise" one)
    extra: dict = field(default_factory=dict)


@dataclass
class Group:
    """A set of entries measured together on identical inputs."""

    case: str
    name: str
    entries: list[Entry]
    rounds: int = 3
    block_s: float = 0.2
    tol: tuple[float, float] | None = (1e-4, 1e-4)
    flops: float | None = None
    meta: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def forward_flops(b: int, s: int, d: int, inner: int, kv: int, causal: bool = False) -> float:
    """FLOPs of one self-attention forward: the four projections plus 4 * b * s^2 * inner for attention
    (half of it when causal, the part a causal kernel computes).

    Shapes:
        x: (b, s, d); inner = h * d_h; kv = h_kv * d_h

    Example:
        >>> forward_flops(1, 2, 4, 4, 4)
        320.0
    """
    proj = 2 * b * s * d * (2 * inner + 2 * kv)  # q, o: d x inner; k, v: d x kv_dim
    attn = 4 * b * s * s * inner * (0.5 if causal else 1.0)
    return float(proj + attn)


def refresh_memory(*modules: Any, huge_pages: bool | None = None) -> None:
    """Give every parameter and buffer of ``modules`` a freshly allocated copy, in order (tensors that share a
    storage, such as headwise's packed W_Q, W_K, W_V, get one new shared storage with the same layout).

    On a virtualised machine a GEMV over weights allocated early in a process can run slower than over a
    later copy of the same weights (docs/benchmarks.md). Every group builds headwise first and
    its peers by copying headwise's weights, which would hand the peers the faster memory; re-allocating
    every entry's tensors after all are built removes that bias.

    Each copy keeps its original's page advice: headwise advises its large weights and caches onto huge
    pages (:mod:`headwise.buffers`), a peer's tensors come from the allocator as a user's would.
    ``huge_pages=True`` advises every large copy (a peer given huge pages on purpose).
    """
    seen: set[int] = set()
    fresh: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # one new copy per storage: shared storage stays shared
    with torch.no_grad():
        for m in modules:
            if isinstance(m, torch.nn.Module):
                tensors = [*m.parameters(), *m.buffers()]
            else:  # e.g. a KVCache that is not a module: its tensor attributes
                tensors = [t for t in vars(m).values() if isinstance(t, torch.Tensor)]
            for t in tensors:
                if id(t) in seen:
                    continue
                seen.add(id(t))
                storage = t.untyped_storage()
                key = (storage.data_ptr(), t.dtype)
                if key not in fresh:
                    whole = torch.empty(0, dtype=t.dtype, device=t.device)
                    whole.set_(storage, 0, (storage.nbytes() // t.element_size(),))
                    if huge_pages or (huge_pages is None and huge_pages_advised(whole)):
                        fresh[key] = fresh_empty(whole.shape, whole.dtype, whole.device).copy_(whole)
                    else:
                        fresh[key] = whole.clone()
                t.data = fresh[key].as_strided(t.shape, t.stride(), t.storage_offset())


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _check(group: Group, outputs: dict[str, Any]) -> dict[str, float | None]:
    """Max |difference| of every entry's output from the headwise entry's (None: not comparable)."""
    main = next((e.name for e in group.entries if e.role == "headwise"), None)
    diffs: dict[str, float | None] = {}
    for e in group.entries:
        if e.ref is None and e.role.startswith("headwise") and e.role != "headwise-compiled":
            diffs[e.name] = None  # a headwise reference itself (another layer than the main one)
            continue
        ref_name = e.ref or main
        ref = _first_tensor(outputs.get(ref_name)) if ref_name else None
        out = _first_tensor(outputs.get(e.name))
        if ref is None or out is None or not e.compare or out.shape != ref.shape:
            diffs[e.name] = None
            continue
        diffs[e.name] = float((out.detach().double() - ref.detach().double()).abs().max())
    return diffs


def _time_block(timer: Timer, number: int, threads: int) -> float:
    """Seconds per call of one block of ``number`` calls.

    ``Timer.timeit`` first runs at least two untimed calls per block, which triples the cost of a
    seconds-long call; every entry here is warmed up once per group instead, so the block is timed with
    the Timer's own clock and thread setting directly (its public call where that is unavailable).
    """
    try:
        from torch.utils.benchmark.utils.common import set_torch_threads

        with set_torch_threads(threads):
            return timer._timeit(number) / number
    except (ImportError, AttributeError):  # pragma: no cover - private API moved in another torch version
        return timer.timeit(number).mean


def run_group(group: Group, *, advance: Callable[[str], None] | None = None) -> dict:
    """Warm up (and check) every entry, then time ``group.rounds`` interleaved rounds.

    Returns a plain dict (JSON-ready): per entry median/min/max seconds per call, calls per block, the
    output difference from headwise, and whether it is within the group's tolerance.
    """
    threads = torch.get_num_threads()
    outputs: dict[str, Any] = {}
    numbers: dict[str, int] = {}
    for e in group.entries:
        if e.reset is not None:
            e.reset()
        t0 = time.perf_counter()
        outputs[e.name] = e.fn()
        warm = time.perf_counter() - t0
        numbers[e.name] = e.number or max(1, math.ceil(group.block_s / max(warm, 1e-7)))
        if advance is not None:
            advance(f"{group.name}: warm {e.name}")
    diffs = _check(group, outputs)
    scales = {name: float(t.detach().abs().max()) for name, out in outputs.items()
              if (t := _first_tensor(out)) is not None and t.numel()}
    del outputs

    times: dict[str, list[float]] = {e.name: [] for e in group.entries}
    timers = {e.name: Timer("fn()", globals={"fn": e.fn}, num_threads=threads) for e in group.entries}
    n = len(group.entries)
    for r in range(group.rounds):
        order = group.entries[r % n:] + group.entries[:r % n]
        for e in order:
            if e.reset is not None:
                e.reset()
            times[e.name].append(_time_block(timers[e.name], numbers[e.name], threads))
            if advance is not None:
                advance(f"{group.name}: {e.name}")

    rows = []
    for e in group.entries:
        ts = times[e.name]
        diff = diffs[e.name]
        ok = None
        if diff is not None and group.tol is not None:
            ok = diff <= group.tol[1] + group.tol[0] * scales.get(e.name, 1.0)
        rows.append({
            "name": e.name, "role": e.role, "median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts),
            "rounds": len(ts), "round_s": ts, "calls_per_round": numbers[e.name], "max_abs_diff_vs_headwise": diff,
            "matches_headwise": ok, "vs": e.ref, "note": e.note,
            **{k: (v() if callable(v) else v) for k, v in e.extra.items()},
        })
    return {"case": group.case, "group": group.name, "threads": threads, "flops": group.flops,
            "meta": group.meta, "notes": list(group.notes), "entries": rows}


def ticks(group: Group) -> int:
    """Progress-bar steps one group takes (warm-up plus every timed block)."""
    return len(group.entries) * (group.rounds + 1)
