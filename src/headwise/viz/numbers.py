"""Lists of head and layer numbers as titles and messages write them (standard library only: the command
line's argument checks use it before torch is imported).

Shapes:
    no tensors
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["span", "plural"]


def span(values: Sequence[int], limit: int = 12) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``: numbers in order, runs joined; past ``limit`` parts, the first few and a
    count.

    Example:
        >>> span([0, 1, 2, 5]), span([3]), span(range(40), limit=3), span([1, 3, 5, 7, 9], limit=3)
        ('0-2, 5', '3', '0-39', '1, 3, 5 and 2 more')
    """
    parts: list[str] = []
    values = list(values)
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if j == i else f"{values[i]}-{values[j]}")
        i = j + 1
    return ", ".join(parts) if len(parts) <= limit else ", ".join(parts[:limit]) + f" and {len(parts) - limit} more"


def plural(n: int, word: str) -> str:
    """``"1 head"``, ``"12 heads"``.

    Example:
        >>> plural(1, "head"), plural(12, "layer")
        ('1 head', '12 layers')
    """
    return f"{n} {word}{'' if n == 1 else 's'}"
