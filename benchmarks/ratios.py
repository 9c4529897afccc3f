"""How two entries of one group are compared: their paired ratio and its spread over processes.

Every group times its entries interleaved, round after round (:mod:`benchmarks.timing`), so the two times of
one round were taken a few seconds apart under the same load. A ratio is therefore taken round by round, and
the median of those per-round ratios is reported: a burst of load from another job that covers some rounds
moves both times of each such round and cancels in its ratio, where it would move one entry's median over
rounds and not the other's (on a shared virtual machine such bursts doubled single rounds). Results written
before per-round times were kept fall back to the per-process medians (one ratio per process, their median).

A ratio is ``a``'s time / ``b``'s time; in the reports ``a`` is headwise, so below 1 means headwise is faster.
"""

from __future__ import annotations

import statistics

__all__ = ["paired_ratio", "ratio_spread", "round_ratios"]


def _rounds(entry: dict) -> list[list[float]] | None:
    """Per-call seconds of every round, per process (one list for a single-process result)."""
    per_process = entry.get("per_process_round_s")
    if per_process:
        return per_process
    rounds = entry.get("round_s")
    return [rounds] if rounds else None


def round_ratios(a: dict, b: dict) -> list[list[float]] | None:
    """``a``'s time / ``b``'s time in each round, per process; None unless both kept per-round times of the
    same rounds (same processes, same round counts).

    Example:
        >>> round_ratios({"round_s": [1.0, 3.0]}, {"round_s": [2.0, 3.0]}), round_ratios({"median_s": 1.0}, {})
        ([[0.5, 1.0]], None)
    """
    ra, rb = _rounds(a), _rounds(b)
    if ra is None or rb is None or len(ra) != len(rb) or any(len(x) != len(y) for x, y in zip(ra, rb)):
        return None
    return [[x / y for x, y in zip(pa, pb)] for pa, pb in zip(ra, rb)]


def paired_ratio(a: dict, b: dict) -> float:
    """Entry ``a``'s time / entry ``b``'s time, from one group: the median of the per-round ratios over every
    round of every process; without per-round times, the median of the per-process ratios of medians
    (several processes) or the ratio of the medians (one).

    Example:
        >>> # a burst covers rounds 3-5 of a but, starting between the two, only rounds 4-5 of b
        >>> a = {"round_s": [1.0, 1.0, 3.0, 3.0, 3.0], "median_s": 3.0}
        >>> b = {"round_s": [1.0, 1.0, 1.0, 3.0, 3.0], "median_s": 1.0}
        >>> paired_ratio(a, b), a["median_s"] / b["median_s"]
        (1.0, 3.0)
        >>> a = {"median_s": 2.0, "per_process_median_s": [1.0, 2.0, 4.0]}
        >>> b = {"median_s": 2.0, "per_process_median_s": [2.0, 1.0, 4.0]}
        >>> paired_ratio(a, b), paired_ratio({"median_s": 3.0}, {"median_s": 2.0})
        (1.0, 1.5)
    """
    per_round = round_ratios(a, b)
    if per_round:
        return statistics.median(r for process in per_round for r in process)
    pa, pb = a.get("per_process_median_s"), b.get("per_process_median_s")
    if pa and pb and len(pa) == len(pb):
        return statistics.median(x / y for x, y in zip(pa, pb))
    return a["median_s"] / b["median_s"]


def ratio_spread(a: dict, b: dict) -> tuple[float, float] | None:
    """(lowest, highest) per-process ratio of ``a`` / ``b`` (each process's median per-round ratio, or its
    ratio of medians), or None for a single-process run."""
    per_round = round_ratios(a, b)
    if per_round is not None:
        if len(per_round) < 2:
            return None
        rs = [statistics.median(p) for p in per_round]
        return min(rs), max(rs)
    pa, pb = a.get("per_process_median_s"), b.get("per_process_median_s")
    if not (pa and pb and len(pa) == len(pb) and len(pa) > 1):
        return None
    rs = [x / y for x, y in zip(pa, pb)]
    return min(rs), max(rs)
