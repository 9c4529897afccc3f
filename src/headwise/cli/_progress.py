"""A progress display for the slow subcommands: a rich progress bar on stderr, or nothing without rich."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


@contextlib.contextmanager
def steps(total: int) -> Iterator[Callable[[str], None]]:
    """``with steps(3) as step: step("loading"); ...``: each call advances the bar and names what runs now."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:  # rich is optional
        yield lambda description: None
        return
    console = Console(file=sys.stderr)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("starting", total=total)
        started = [False]

        def step(description: str) -> None:
            if started[0]:
                progress.advance(task)
            started[0] = True
            progress.update(task, description=description)

        yield step
        progress.update(task, completed=total)
