"""Interleaved timing with an honest-peer check.

A :class:`Group` is a set of entries that compute the same thing on the same inputs. :func:`run_group` calls
each entry once (warm-up), checks every entry's output against its reference entry's, then times
``rounds`` rounds; each round times one block of calls per entry, the entries in rotating order (two entries in
a fixed one: see :func:`round_order`), so slow drift of a shared machine lands on every entry alike. With ``memory=True`` it also measures each entry's peak
resident memory above what was resident before the call: on one extra call after the rounds, or with
``memory_on_warmup`` on the warm-up call itself (for entries whose one call takes seconds; that figure then
includes the first call's one-off allocations, as a user's single run would).
"""

from __future__ import annotations

import ctypes
import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["Entry", "Group", "run_group", "round_order", "compare", "peak_rss_above"]


@dataclass
class Entry:
    """One implementation in a comparison.

    ``fn`` is the timed call. Its first call's output is compared with entry ``ref``'s (default: the group's
    first entry) unless ``compare`` is False. ``reset`` (untimed) runs before the warm-up and before every
    block (a decoder rewinds its cache there). ``number`` fixes the calls per block (else calibrated).
    ``held`` is what the call leaves held, as (bytes, units), measured by the case (a K/V cache's bytes and its
    K/V heads), for goals of metric "held".
    """

    name: str
    fn: Callable[[], Any]
    ref: str | None = None
    compare: bool = True
    reset: Callable[[], None] | None = None
    number: int | None = None
    note: str = ""
    held: tuple[int, int] | None = None


@dataclass
class Group:
    """Entries measured together; ``key`` names the group for the goals, ``base`` is the entry every table
    ratio divides by, ``tol`` the (rtol, atol) of the output check; ``memory_on_warmup`` measures the peak
    memory on the warm-up call instead of an extra call."""

    key: str
    title: str
    entries: list[Entry]
    base: str
    rounds: int = 5
    block_s: float = 0.2
    tol: tuple[float, float] = (2e-4, 2e-5)
    memory: bool = False
    memory_on_warmup: bool = False
    notes: list[str] = field(default_factory=list)
    #: Called before a block's clock starts and before it stops (a CUDA group waits for the device there).
    sync: Callable[[], None] | None = None
    #: The peak-memory measure of one call (default: resident memory above the level before it).
    peak: Callable[[Callable[[], Any]], int | None] | None = None


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def compare(out: Any, ref: Any, tol: tuple[float, float]) -> tuple[float, bool]:
    """(largest |out - ref| over every tensor, whether each tensor is within ``atol + rtol * max|ref|``).

    Outputs are tensors or (nested) lists of tensors; a different count or shape is a mismatch.

    Example:
        >>> compare([torch.ones(2)], [torch.ones(2) + 1e-6], (1e-4, 0.0))
        (9.5367431640625e-07, True)
        >>> compare(torch.ones(2), torch.ones(3), (1e-4, 0.0))
        (inf, False)
    """
    a, b = _tensors(out), _tensors(ref)
    if not a or len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return math.inf, False
    diff, ok = 0.0, True
    for x, y in zip(a, b):
        x, y = x.detach().double(), y.detach().double()
        d = float((x - y).abs().max()) if x.numel() else 0.0
        diff = max(diff, d)
        ok = ok and d <= tol[1] + tol[0] * (float(y.abs().max()) if y.numel() else 0.0)
    return diff, ok


def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_above(fn: Callable[[], Any]) -> int | None:
    """Bytes the resident set rose above its level before ``fn()`` at its highest during the call, its
    output included (Linux: freed heap is returned first, then the high-water mark is reset through
    ``/proc/self/clear_refs``); None where that is unavailable.

    Example (64 MiB: above glibc's largest mmap threshold, so fresh pages whatever the heap holds free):
        >>> peak = peak_rss_above(lambda: torch.ones(1 << 24))
        >>> peak is None or peak >= 60 << 20
        True
    """
    return _measured_call(fn)[2]


def _measured_call(fn: Callable[[], Any]) -> tuple[Any, float, int | None]:
    """``fn()``'s output, its seconds and :func:`peak_rss_above`'s bytes; the clock runs only over the call."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS")
    except (OSError, AttributeError):
        before = None
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM") if before is not None else None
    return out, seconds, None if before is None or peak is None else max(0, peak - before) * 1024


def round_order(entries: list, r: int) -> list:
    """The order of round ``r``: rotated by one each round (slow drift lands on every entry alike), except that
    two entries keep one order. Rotating two would run each twice in a row at every other round boundary, and a
    block that follows its own finds its weights and cache still in the CPU's caches: with working sets of
    tens of MiB that alone moved a paired ratio by ~30 %, alternately for and against each entry. In a fixed
    order each block follows the other entry's.

    Example:
        >>> [round_order(list("abc"), r) for r in range(3)]
        [['a', 'b', 'c'], ['b', 'c', 'a'], ['c', 'a', 'b']]
        >>> [round_order(list("ab"), r) for r in range(2)]
        [['a', 'b'], ['a', 'b']]
    """
    n = len(entries)
    return list(entries) if n <= 2 else entries[r % n:] + entries[:r % n]


def run_group(group: Group) -> dict:
    """Warm up and check every entry, then time ``group.rounds`` interleaved rounds; a JSON-ready dict.

    Each entry's ``round_s`` is one list (this process) of seconds per call, one per round.
    """
    outputs: dict[str, Any] = {}
    numbers: dict[str, int] = {}
    peaks: dict[str, int | None] = {}
    for e in group.entries:
        if e.reset is not None:
            e.reset()
        if group.memory and group.memory_on_warmup and group.peak is None:
            outputs[e.name], seconds, peaks[e.name] = _measured_call(e.fn)
        else:
            t0 = time.perf_counter()
            outputs[e.name] = e.fn()
            if group.sync is not None:
                group.sync()
            seconds = time.perf_counter() - t0
        numbers[e.name] = e.number or max(1, math.ceil(group.block_s / max(seconds, 1e-7)))
    first = group.entries[0].name
    checks = {}
    for e in group.entries:
        ref = e.ref or first
        if e.compare and e.name != ref:
            checks[e.name] = (ref, *compare(outputs[e.name], outputs[ref], group.tol))
    del outputs

    times: dict[str, list[float]] = {e.name: [] for e in group.entries}
    for r in range(group.rounds):
        for e in round_order(group.entries, r):
            if e.reset is not None:
                e.reset()
            calls = numbers[e.name]
            fn = e.fn
            if group.sync is not None:
                group.sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            if group.sync is not None:
                group.sync()
            times[e.name].append((time.perf_counter() - t0) / calls)

    rows = []
    for e in group.entries:
        ref, diff, ok = checks.get(e.name, (None, None, None))
        peak = peaks.get(e.name)
        if group.memory and (not group.memory_on_warmup or group.peak is not None):
            if e.reset is not None:
                e.reset()
            peak = (group.peak or peak_rss_above)(e.fn)
        rows.append({"name": e.name, "note": e.note, "round_s": [times[e.name]], "calls": numbers[e.name],
                     "median_s": statistics.median(times[e.name]), "checked_against": ref,
                     "max_abs_diff": diff, "matches": ok, "peak_bytes": peak,
                     "held": None if e.held is None else list(e.held)})
    return {"key": group.key, "title": group.title, "base": group.base, "threads": torch.get_num_threads(),
            "notes": list(group.notes), "entries": rows}
