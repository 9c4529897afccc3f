"""Output helpers shared by the subcommands: rich tables when rich is installed, plain text otherwise,
and JSON for ``--json``."""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence


def emit_json(payload: Any) -> None:
    json.dump(payload, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print a table to stdout."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is optional: fall back to aligned plain text
        cells = [list(map(str, columns))] + [[str(c) for c in r] for r in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
        sys.stdout.write(f"{title}\n")
        for r in cells:
            sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")
        return
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(str(c))
    for r in rows:
        t.add_row(*[str(c) for c in r])
    Console(file=sys.stdout, width=max(100, _terminal_width())).print(t)


def line(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def _terminal_width() -> int:
    import shutil

    return shutil.get_terminal_size((140, 24)).columns
