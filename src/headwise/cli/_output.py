"""Files the commands write (``--out``): checked before any model loads, written atomically.

:func:`check_out` refuses, in a fraction of a second, every path the write would fail on later: a
directory, a missing or virtual (``/proc``, ``/sys``, ``/dev``) directory, something that is not a regular
file, a directory this process cannot create files in, a full disk. It does so by creating, writing,
syncing and removing a small scratch file next to the target, so the answer is the file system's own.
:func:`write_atomically` writes to a scratch file in the same directory and renames it over the target
only once complete: a failed write leaves the target as it was, and an existing target keeps its
permissions (a symlink's target's); it is :func:`headwise.viz.files.write_atomically`, the pictures' own.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Sequence

from ..viz import files
from . import CliError

# Bytes the pre-flight writes (and syncs) to find out whether the disk has room at all.
PROBE_BYTES = 64 * 1024
# File systems that are views of the kernel, not storage.
VIRTUAL_ROOTS = ("/proc", "/sys", "/dev")


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def check_out(out: str, suffixes: Sequence[str], option: str = "--out") -> Path:
    """The path to write ``out`` to, once it is known that writing there can work (module doc)."""
    path = Path(out)
    if path.is_dir():
        raise CliError(f"{option} {out!r} is a directory; name a file in it, e.g. {str(path / ('heads' + suffixes[0]))!r}")
    if not path.suffix and path.name.lower() in suffixes:  # ".png" is a hidden file without a suffix to Path
        raise CliError(f"{option} {out!r} is only a suffix; name the file, e.g. "
                       f"{str(path.with_name('heads' + path.name.lower()))!r}")
    if path.suffix.lower() not in suffixes:
        raise CliError(f"{option} must end in {' or '.join(suffixes)}, got {out!r}")
    real = Path(os.path.realpath(path))
    for root in VIRTUAL_ROOTS:
        if real == Path(root) or Path(root) in real.parents:
            raise CliError(f"{option} {out!r} is under {root}, a virtual file system, not storage; "
                           f"choose a path on a disk")
    parent = real.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        if path.is_symlink():  # the directory that fails is the link target's, not the one holding the link
            raise CliError(f"{option} {out!r} is a symlink into directory {str(parent)!r}, which {what}")
        raise CliError(f"{option}: directory {str(path.parent)!r} {what}")
    if real.exists():
        mode = real.stat().st_mode
        if not stat.S_ISREG(mode):
            raise CliError(f"{option} {out!r} exists and is not a regular file")
    try:
        fd, scratch = tempfile.mkstemp(prefix=".headwise-probe-", dir=parent)
    except OSError as exc:
        raise CliError(f"{option}: cannot create files in {str(parent)!r}: {_reason(exc)}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise CliError(f"{option}: cannot write to {str(parent)!r}: {_reason(exc)}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(scratch)
    return path


@contextlib.contextmanager
def write_atomically(path: Path, option: str = "--out") -> Iterator[Path]:
    """``with write_atomically(p) as tmp: save(tmp)``: ``tmp`` (same directory and suffix) replaces ``p``
    when the block succeeds; on any failure it is removed and ``p`` is untouched (OSError -> CliError). The
    pictures' own writer (:func:`headwise.viz.files.write_atomically`), with the option named in its errors."""
    started = False
    try:
        with files.write_atomically(path) as tmp:
            started = True
            yield tmp
    except OSError as exc:
        if not started:
            parent = Path(os.path.realpath(path)).parent
            raise CliError(f"{option}: cannot create files in {str(parent)!r}: {_reason(exc)}") from None
        raise CliError(f"{option}: writing {str(path)!r} failed: {_reason(exc)}") from None


def save(path: Path, writer: Callable[[Path], object], option: str = "--out") -> None:
    """Write ``path`` with ``writer(tmp_path)``, atomically (see :func:`write_atomically`)."""
    with write_atomically(path, option) as tmp:
        writer(tmp)
