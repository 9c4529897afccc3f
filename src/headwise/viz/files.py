"""Writing a picture's file: atomically, at a resolution that fits in memory, and only text a file can hold.

:func:`write_atomically` writes to a scratch file in the target's directory and renames it over the target only
once complete: a failed write (an error while drawing, a full disk) leaves an existing file as it was, and an
existing target keeps its permissions (a symlink's target's). The command line's ``--out`` writes through it too
(:mod:`headwise.cli._output`), so there is one way to replace a file.

:func:`check_text` refuses, before anything is drawn, text that UTF-8 cannot encode (a lone surrogate, from
bytes decoded with ``surrogateescape``): a page could not be written, and matplotlib fails deep in its font code.
:func:`check_dpi` refuses a resolution outside [:data:`MIN_DPI`, :data:`MAX_DPI`]: a figure of a few inches at
100000 dpi is gigapixels, which ends in a MemoryError after minutes rather than in a message.
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator

__all__ = ["write_atomically", "check_text", "check_dpi", "MIN_DPI", "MAX_DPI"]

MIN_DPI, MAX_DPI = 10, 600  # below: nothing legible; above: print resolution many times over, and memory runs out


@contextlib.contextmanager
def write_atomically(path: Path) -> Iterator[Path]:
    """``with write_atomically(p) as tmp: save(tmp)``: ``tmp`` (same directory and suffix) replaces ``p`` when
    the block succeeds; on any failure it is removed, ``p`` is untouched and the error propagates (an OSError
    from creating the scratch file is raised before the block runs)."""
    real = Path(os.path.realpath(path))
    try:
        fd, name = tempfile.mkstemp(prefix=".headwise-", suffix=path.suffix, dir=real.parent)
    except OSError as err:  # named by its target: the scratch file's random name would tell the user nothing
        raise type(err)(err.errno, f"cannot create files in {str(real.parent)!r}: {err.strerror}",
                        str(path)) from None
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _mode_for(real))
        os.replace(tmp, real)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _mode_for(real: Path) -> int:
    """Permissions for the file that replaces ``real`` (a path with symlinks resolved)."""
    try:
        # an existing file keeps its mode: overwriting a private (0600) file must not make it world-readable
        return stat.S_IMODE(os.stat(real).st_mode)
    except FileNotFoundError:
        return 0o644 & ~_umask()  # mkstemp's 0600 is for scratch files; a new file gets what open() would give


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_text(name: str, value: Any) -> str:
    """``value`` if it is a str that UTF-8 can encode; TypeError / ValueError naming ``name`` otherwise.

    Example:
        >>> check_text("title", "Layer 2")
        'Layer 2'
        >>> check_text("title", "bad \\udcff")
        Traceback (most recent call last):
        ValueError: title must be valid Unicode (encodable as UTF-8), got '\\udcff' at character 4, a lone surrogate (bytes that were not UTF-8?)
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__} {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} must be valid Unicode (encodable as UTF-8), got {value[exc.start]!r} at character "
                         f"{exc.start}, a lone surrogate (bytes that were not UTF-8?)") from None
    return value


def check_dpi(dpi: Any) -> None:
    """TypeError / ValueError naming ``dpi`` unless it is a number in [:data:`MIN_DPI`, :data:`MAX_DPI`]."""
    if isinstance(dpi, bool) or not isinstance(dpi, (int, float)):
        raise TypeError(f"dpi must be a number, got {type(dpi).__name__}")
    if not math.isfinite(dpi) or dpi <= 0:
        raise ValueError(f"dpi must be a positive finite number, got {dpi}")
    if not MIN_DPI <= dpi <= MAX_DPI:
        raise ValueError(f"dpi must be between {MIN_DPI} and {MAX_DPI} (dots per inch), got {dpi}")
