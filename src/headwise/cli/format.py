"""Output helpers shared by the subcommands: tables and text that fit the terminal's width (rich tables
when rich is installed, aligned plain text otherwise), and JSON for ``--json``.

The width is ``$COLUMNS``, else the terminal's, else 80. A table wider than that first drops its
``optional`` columns (saying so), then wraps its cells; where its columns would still be narrower than
``MIN_COLUMN``, it is split into parts of whole columns, each repeating the first (the row labels). No
column is lost without a note and no line is ever wider than the width or cut.
"""

from __future__ import annotations

import io
import json
import math
import numbers
import os
import shutil
import sys
import textwrap
from typing import Any, Sequence

from ..viz.numbers import plural  # noqa: F401 - the CLI writes counts as the pictures do

# Narrower than this and a table cannot show anything legibly; the width is clamped up to it.
MIN_WIDTH = 40
# Narrower than this a wrapped column is hard to read (and rich would shrink it to nothing): the table is split.
MIN_COLUMN = 10
# Characters a table adds to its cells, at most, per column: rich's padding (one each side, none at the edges),
# its dividers and two edges; plain text needs less (two spaces between columns), so what fits rich fits both.
_PER_COLUMN = 3


def width() -> int:
    """Columns available on stdout: $COLUMNS, else the terminal's width, else 80."""
    try:
        cols = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        cols = 0
    if cols <= 0:
        cols = shutil.get_terminal_size((80, 24)).columns
    return max(MIN_WIDTH, cols)


def emit_json(payload: Any) -> None:
    """Print ``payload`` as one strict JSON document (RFC 8259): a NaN or infinite number becomes null."""
    # NaN / Infinity are not JSON: strict parsers (JavaScript's JSON.parse, Go, serde) reject the whole
    # document, so they become null, and allow_nan=False makes any that slipped through an error, not output.
    text = json.dumps(_finite(payload), indent=2, default=str, allow_nan=False)
    sys.stdout.write(text + "\n")


def _finite(value: Any) -> Any:
    """``value`` with every non-finite real number (float, numpy scalar) replaced by None, containers rebuilt."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        number = float(value)  # numpy's float32 is no float subclass: default=str would quote it
        return number if math.isfinite(number) else None
    return value


def line(text: str = "", *, indent: str = "    ") -> None:
    """Print ``text``, wrapped to the width; continuation lines get ``indent`` beyond the text's own."""
    if not text.strip():
        sys.stdout.write(text.rstrip() + "\n")
        return
    lead = text[:len(text) - len(text.lstrip())]
    wrapped = textwrap.wrap(text.strip(), width=width(), initial_indent=lead, subsequent_indent=lead + indent,
                            break_long_words=True, break_on_hyphens=False)
    sys.stdout.write("\n".join(wrapped) + "\n")


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *,
          optional: Sequence[str] = ()) -> None:
    """Print a table to stdout, fitted to the width (see the module doc)."""
    cells = [[str(c) for c in r] for r in rows]
    keep = list(range(len(columns)))
    dropped: list[str] = []
    for name in optional:  # the least needed first
        if _natural_width([columns[i] for i in keep], [[r[i] for i in keep] for r in cells]) <= width():
            break
        if name in columns and columns.index(name) in keep and len(keep) > 1:
            keep.remove(columns.index(name))
            dropped.append(name)
    parts = _parts([str(columns[i]) for i in keep], [[r[i] for i in keep] for r in cells])
    for n, (cols, body) in enumerate(parts, 1):
        _render(title if len(parts) == 1 else f"{title} (part {n} of {len(parts)})", cols, body)
    if dropped:
        line(f"(columns left out to fit {width()} columns: {', '.join(dropped)}; a wider terminal or --json "
             f"shows them)")


def _render(title: str, cols: list[str], body: list[list[str]]) -> None:
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is optional: aligned plain text
        _plain(title, cols, body)
    else:
        t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, expand=False)
        for c in cols:
            t.add_column(c, overflow="fold")
        for r in body:
            t.add_row(*r)
        buffer = io.StringIO()  # rendered off-terminal (no colour codes), so trailing padding can be cut
        Console(file=buffer, width=width(), soft_wrap=False).print(t)
        sys.stdout.write("".join(ln.rstrip() + "\n" for ln in buffer.getvalue().splitlines()))


def _parts(columns: list[str], rows: list[list[str]]) -> list[tuple[list[str], list[list[str]]]]:
    """The table as one part, or, where its columns would not fit at ``MIN_COLUMN`` each (or their own
    width where less), as parts of consecutive columns, each led by the first column, as even as fit."""
    floors = [min(MIN_COLUMN, max([len(c)] + [len(r[i]) for r in rows])) for i, c in enumerate(columns)]

    def fits(group: Sequence[int]) -> bool:
        return floors[0] + sum(floors[i] for i in group) + _PER_COLUMN * (len(group) + 1) <= width()

    rest = list(range(1, len(columns)))
    if len(columns) < 3 or fits(rest):
        return [(columns, rows)]
    groups: list[list[int]] = [[]]
    for i in rest:  # greedy: the fewest parts
        if groups[-1] and not fits(groups[-1] + [i]):
            groups.append([])
        groups[-1].append(i)
    size = -(-len(rest) // len(groups))  # the same number of parts, as even as they come
    even = [rest[k:k + size] for k in range(0, len(rest), size)]
    if len(even) == len(groups) and all(fits(g) for g in even):
        groups = even
    return [([columns[0]] + [columns[i] for i in g], [[r[0]] + [r[i] for i in g] for r in rows]) for g in groups]


def _natural_width(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> int:
    """Width of the table with no cell wrapped: the widest cell of each column, plus separators."""
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    return sum(widths) + 2 * (len(widths) - 1)


def _plain(title: str, columns: list[str], rows: list[list[str]]) -> None:
    avail = width()
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    while sum(widths) + 2 * (len(widths) - 1) > avail and max(widths) > 1:
        widths[widths.index(max(widths))] -= 1  # shrink the widest column; its cells wrap (_parts made room)
    line(title)
    for r in [columns, ["-" * w for w in widths], *rows]:
        wrapped = [textwrap.wrap(c, width=w, break_long_words=True, break_on_hyphens=False) or [""]
                   for c, w in zip(r, widths)]
        for k in range(max(len(w) for w in wrapped)):
            text = "  ".join((w[k] if k < len(w) else "").ljust(wd) for w, wd in zip(wrapped, widths)).rstrip()
            sys.stdout.write(text + "\n")
