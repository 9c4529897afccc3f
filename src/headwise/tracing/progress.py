"""A progress bar for the long sweeps and scores (``head_effects``, ``ablation_importance``, ...): tqdm's (a
widget in a notebook where ipywidgets is installed, text on stderr otherwise), or a one-line fallback on
stderr where tqdm is not installed (``import headwise`` needs only torch).

``progress=None`` (the default of every caller) shows it only on a terminal or in a notebook, and only once
the work has run for :data:`DELAY_S` seconds, so a quick call prints nothing and logs and tests stay clean;
``progress=True`` shows it at once wherever stderr goes; ``progress=False`` never. The bar is removed when
the work ends.

Shapes:
    no tensors: steps are forwards (or backwards) of the model
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import time
from typing import Any, Callable, Iterator

__all__ = ["progress_bar", "DELAY_S", "check_progress"]

DELAY_S = 0.5  # auto mode: a bar appears only for work that lasts longer than this
_REDRAW_S = 0.1  # the fallback redraws at most this often


def check_progress(progress: Any, what: str) -> None:
    """``TypeError`` naming ``what`` unless ``progress`` is None, True or False."""
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"{what}: progress must be None (a bar on a terminal or in a notebook), True or False, "
                        f"got {type(progress).__name__}")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing, or blocked with sys.modules[name] = None
        return False


def _in_notebook() -> bool:
    return "ipykernel" in sys.modules and not sys.stderr.isatty()


def _interactive() -> bool:
    try:
        return sys.stderr.isatty() or _in_notebook()
    except (AttributeError, ValueError):  # stderr replaced by an object without isatty, or closed
        return False


@contextlib.contextmanager
def progress_bar(total: int, description: str, progress: bool | None) -> Iterator[Callable[[int], None]]:
    """``with progress_bar(n, "head_effects", progress) as advance: ... advance(1)``: a bar of ``n`` steps (see the
    module doc for when it shows); ``advance`` does nothing when it does not."""
    if progress is False or total < 1 or (progress is None and not _interactive()):
        yield lambda k=1: None
        return
    delay = DELAY_S if progress is None else 0.0
    if not _installed("tqdm"):
        with _fallback(total, description, delay) as advance:
            yield advance
        return
    if _in_notebook() and _installed("ipywidgets"):
        from tqdm.notebook import tqdm
    else:
        from tqdm import tqdm
    bar = tqdm(total=total, desc=description, leave=False, delay=delay, file=sys.stderr, dynamic_ncols=True)
    try:
        yield lambda k=1: bar.update(k)
    finally:
        bar.close()


@contextlib.contextmanager
def _fallback(total: int, description: str, delay: float) -> Iterator[Callable[[int], None]]:
    """One line on stderr, ``description: 3/12``, redrawn in place and erased at the end."""
    stream, start = sys.stderr, time.monotonic()
    state = {"done": 0, "drawn": 0.0, "shown": False}

    def advance(k: int = 1) -> None:
        state["done"] += k
        now = time.monotonic()
        if now - start < delay or now - state["drawn"] < _REDRAW_S and state["done"] < total:
            return
        stream.write(f"\r{description}: {state['done']}/{total}\033[K")
        stream.flush()
        state["drawn"], state["shown"] = now, True

    try:
        yield advance
    finally:
        if state["shown"]:
            stream.write("\r\033[K")
            stream.flush()
