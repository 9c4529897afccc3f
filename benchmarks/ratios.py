"""The ratio statistic: how two entries of one group are compared.

Every group times its entries in interleaved rounds (:mod:`benchmarks.timing`), so the two times of one round
were taken seconds apart under the same load. A ratio is therefore taken round by round, and the reported
ratio is the median of the per-round ratios, pooled over every round of every process. A burst of load that
covers some rounds moves both times of each such round and cancels in its ratio, where it would move one
entry's median over rounds and not the other's.

An entry's ``round_s`` holds its seconds per call, one list of rounds per process.
"""

from __future__ import annotations

import statistics

__all__ = ["round_ratios", "paired_ratio", "process_spread"]


def round_ratios(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    """``a``'s time / ``b``'s time in each round, per process.

    Raises ``ValueError`` unless both hold the same number of processes and of rounds in each.

    Example:
        >>> round_ratios([[1.0, 3.0]], [[2.0, 3.0]])
        [[0.5, 1.0]]
    """
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)) or not a or not all(a):
        raise ValueError(f"paired rounds need the same rounds on both sides, got {[len(x) for x in a]} "
                         f"and {[len(y) for y in b]} rounds per process")
    return [[x / y for x, y in zip(pa, pb)] for pa, pb in zip(a, b)]


def paired_ratio(a: list[list[float]], b: list[list[float]]) -> float:
    """The median of the per-round ratios ``a / b`` over every round of every process.

    Example:
        >>> # a burst covers rounds 3-5 of a but, starting between the two, only rounds 4-5 of b
        >>> a, b = [[1.0, 1.0, 3.0, 3.0, 3.0]], [[1.0, 1.0, 1.0, 3.0, 3.0]]
        >>> paired_ratio(a, b), statistics.median(a[0]) / statistics.median(b[0])
        (1.0, 3.0)
    """
    return statistics.median(r for process in round_ratios(a, b) for r in process)


def process_spread(a: list[list[float]], b: list[list[float]]) -> tuple[float, float] | None:
    """(lowest, highest) of each process's own median per-round ratio; None for a single process.

    Example:
        >>> process_spread([[1.0, 2.0], [3.0, 4.0]], [[1.0, 1.0], [2.0, 2.0]])
        (1.5, 1.75)
        >>> process_spread([[1.0]], [[2.0]]) is None
        True
    """
    per = [statistics.median(p) for p in round_ratios(a, b)]
    return (min(per), max(per)) if len(per) > 1 else None
