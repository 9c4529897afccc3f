"""A one-line progress display for the slow subcommands, on stderr, only when stderr is a terminal (never
in --json runs, never on stdout). Standard library only: it runs before torch is imported."""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
import time
from typing import Callable, Iterator

# How often the elapsed time is redrawn while a step runs.
_TICK_S = 0.25


@contextlib.contextmanager
def steps(total: int, *, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """``with steps(3) as step: step("loading"); ...``: each call names what runs now, as
    ``[2/3] loading (4 s)`` on one line of stderr; the line is erased when the block ends.

    Shown only when ``enabled`` and stderr is a terminal; otherwise ``step`` does nothing.
    """
    stream = sys.stderr
    if not (enabled and stream is not None and stream.isatty()):  # None: stderr closed (`2>&-`)
        yield lambda description: None
        return
    state = {"i": 0, "what": "", "t0": time.monotonic()}
    lock = threading.Lock()
    stop = threading.Event()

    def draw() -> None:
        with lock:
            text = f"[{state['i']}/{total}] {state['what']} ({time.monotonic() - state['t0']:.0f} s)"
            cols = shutil.get_terminal_size((80, 24)).columns
            stream.write("\r" + text[:max(1, cols - 1)] + "\033[K")
            stream.flush()

    def tick() -> None:
        while not stop.wait(_TICK_S):
            draw()

    def step(description: str) -> None:
        with lock:
            state["i"] = min(total, state["i"] + 1)
            state["what"], state["t0"] = description, time.monotonic()
        draw()

    thread = threading.Thread(target=tick, name="headwise-progress", daemon=True)
    thread.start()
    try:
        yield step
    finally:
        stop.set()
        thread.join()
        stream.write("\r\033[K")
        stream.flush()
