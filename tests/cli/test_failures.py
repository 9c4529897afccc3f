"""Every way the CLI can fail, one table: each row runs `python -m headwise ...` in a fresh process and
asserts the exit code (2; 1 only where a check ran and failed), exactly one non-empty line on stderr,
no traceback anywhere, and, for bad input, an answer within 2 s of wall clock (before any model or torch
loads). The rows that run a check must import torch and the checked module, so they get a longer bound.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GALLERY = "tests.checks.check_gallery"
FAST_S = 2.0  # the bound for a failure on bad input
CHECK_S = 60.0  # a check that ran: torch, the user's module and the properties

# Preludes run in the child before the CLI: they make the environment fail the way the row describes.
NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None"
NO_TRANSFORMERS = "import sys; sys.modules['transformers'] = None"
DISK_FULL = ("import errno, os\n"
             "def fsync(fd): raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
             "os.fsync = fsync")

T = "The cat sat on the mat."
ROWS = [
    # (id, argv, expected exit code, text the stderr line must contain, prelude)
    ("out-is-a-directory", ["heads", T, "--out", "{tmp}"], 2, "is a directory", None),
    ("out-under-proc", ["heads", T, "--out", "/proc/heads.png"], 2, "under /proc, a virtual file system", None),
    ("out-under-sys", ["heads", T, "--out", "/sys/heads.png"], 2, "under /sys, a virtual file system", None),
    ("out-to-dev-full", ["heads", T, "--out", "{tmp}/full.png"], 2, "under /dev, a virtual file system", None),
    ("out-disk-full", ["heads", T, "--out", "{tmp}/h.png"], 2, "No space left on device", DISK_FULL),
    ("out-parent-is-a-file", ["heads", T, "--out", "{tmp}/afile/h.png"], 2, "is not a directory", None),
    ("out-parent-missing", ["heads", T, "--out", "{tmp}/nope/h.png"], 2, "does not exist", None),
    ("out-symlink-into-missing-dir", ["heads", T, "--out", "{tmp}/dangling.html"], 2,
     "'{tmp}/dangling.html' is a symlink into directory '/nonexistent-headwise-dir', which does not exist", None),
    ("out-unwritable-dir", ["heads", T, "--out", "{tmp}/ro/h.png"], 2, "cannot create files in", None),
    ("out-bad-suffix", ["heads", T, "--out", "{tmp}/h.jpg"], 2, "must end in .png or .html", None),
    ("out-only-a-suffix", ["heads", T, "--out", "{tmp}/.png"], 2,
     "--out '{tmp}/.png' is only a suffix; name the file, e.g. '{tmp}/heads.png'", None),
    ("heads-layer-6", ["heads", T, "--layer", "6"], 2, "[-6, 6) for the 6-layer bundled model", None),
    ("heads-max-tokens-past-positions", ["heads", T, "--max-tokens", "1000"], 2, "at most 512", None),
    ("heads-empty-text", ["heads", " "], 2, "text must not be empty", None),
    ("heads-model-missing", ["heads", T, "--model", "{tmp}/nope"], 2, "nor an existing directory", None),
    ("heads-model-without-config", ["heads", T, "--model", "{tmp}"], 2, "has no config.json", None),
    ("heads-layer-and-all-layers", ["heads", T, "--layer", "1", "--all-layers"], 2, "not allowed with", None),
    ("heads-head-past-12", ["heads", T, "--heads", "0,12"], 2, "heads must be in [0, 12)", None),
    ("heads-png-without-matplotlib", ["heads", T, "--out", "{tmp}/h.png"], 2, "pip install 'headwise[viz]'",
     NO_MATPLOTLIB),
    ("heads-without-transformers", ["heads", T], 2, "pip install 'headwise[hf]'", NO_TRANSFORMERS),
    ("tour-seq-1e9", ["tour", "--seq", "1000000000"], 2, "over its limit of 2.0 GiB", None),
    ("tour-batch-1e7-seq-1000", ["tour", "--batch", "10000000", "--seq", "1000"], 2, "over its limit of 2.0 GiB",
     None),
    ("tour-gpt3", ["tour", "--preset", "gpt3-175b"], 2, "`headwise explain` walks any size", None),
    ("tour-seq-not-a-number", ["tour", "--seq", "x"], 2, "invalid int value: 'x'", None),
    ("explain-storage-overflow", ["explain", "--d-model", str(10 ** 12), "--n-heads", "8"], 2,
     "more than the 2**63 - 1 a torch tensor can address", None),
    ("explain-seq-1e15", ["explain", "--preset", "llama-2-7b", "--seq", str(10 ** 15)], 2,
     "more than the 2**63 - 1", None),
    ("explain-bad-dtype", ["explain", "--d-model", "64", "--n-heads", "8", "--dtype", "float17"], 2,
     "dtype must be", None),
    ("explain-heads-do-not-divide", ["explain", "--d-model", "100", "--n-heads", "7"], 2,
     "does not divide d_model=100", None),
    ("compare-seq-1e30", ["compare", "llama-2-7b", "--seq", str(10 ** 30)], 2, "must be at most 2**63 - 1", None),
    ("compare-misspelt", ["compare", "llama3-8b"], 2, "did you mean: llama-3-8b", None),
    ("check-d-model-1e12", ["check", f"{GALLERY}:reference", "--d-model", str(10 ** 12)], 2,
     "over the limit of 256 MiB", None),
    ("check-d-model-0", ["check", f"{GALLERY}:reference", "--d-model", "0"], 2, "must be a positive integer, got 0",
     None),
    ("check-d-model-0-no-target", ["check", "--d-model", "0"], 2, "must be a positive integer, got 0", None),
    ("check-no-colon", ["check", "no_colon"], 2, "MODULE:FACTORY", None),
    ("check-unknown-property", ["check", f"{GALLERY}:reference", "--property", "nope"], 2, "invalid choice", None),
    ("unknown-command", ["nope"], 2, "invalid choice: 'nope'", None),
    # a check that ran and did not pass: exit 1, the verdict on stderr
    ("check-identity-is-not-attention", ["check", "torch.nn:Identity", "--d-model", "16"], 1,
     "NOT VERIFIED: core properties could not run: softmax_sanity", None),
    ("check-layer-calls-sys-exit", ["check", f"{GALLERY}:exits_after_first_call"], 1, "FAILED:", None),
    ("check-layer-always-exits", ["check", f"{GALLERY}:ExitsAlways", "--d-model", "8"], 2, "SystemExit", None),
]


@pytest.fixture
def places(tmp_path: Path) -> Path:
    (tmp_path / "full.png").symlink_to("/dev/full")
    (tmp_path / "afile").write_text("")
    (tmp_path / "dangling.html").symlink_to("/nonexistent-headwise-dir/h.html")
    (tmp_path / "ro").mkdir(mode=0o500)
    return tmp_path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,argv,code,message,prelude", ROWS, ids=[r[0] for r in ROWS])
def test_failure_is_one_line(places: Path, name: str, argv: list[str], code: int, message: str,
                             prelude: str | None) -> None:
    if name == "out-unwritable-dir" and os.geteuid() == 0:
        pytest.skip("root may create files in a mode-0500 directory")
    argv = [a.replace("{tmp}", str(places)) for a in argv]
    if prelude is None:
        cmd = [sys.executable, "-m", "headwise", *argv]
    else:
        cmd = [sys.executable, "-c", f"{prelude}\nimport runpy\nrunpy.run_module('headwise', run_name='__main__')",
               *argv]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    seconds = time.perf_counter() - start
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert message.replace("{tmp}", str(places)) in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    limit = CHECK_S if name.startswith(("check-identity", "check-layer")) else FAST_S
    assert seconds < limit, f"{seconds:.2f} s"
