"""The torchrun example runs on 2 CPU ranks (gloo) and reports a tiny difference from one process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel.spawn import torchrun

pytestmark = [pytest.mark.xdist_group("parallel"), pytest.mark.timeout(180)]


def _run(*extra: str) -> subprocess.CompletedProcess:
    return torchrun("examples.tensor_parallel", *extra)


def test_torchrun_example_reports_heads_and_a_tiny_difference():
    proc = _run("--dtype", "float64", "--timeout", "60")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "rank 0/2: query heads [0, 1, 2, 3], K/V heads [0]" in out
    assert "rank 1/2: query heads [4, 5, 6, 7], K/V heads [1]" in out
    per_rank = [float(v) for v in re.findall(r"(?:forward|gradients|decoding) ([0-9.e+-]+)", out)]
    assert len(per_rank) == 6
    worst = float(re.search(r"max difference from the single-process result \(float64, all ranks\): ([0-9.e+-]+)",
                            out).group(1))
    assert worst == max(per_rank)
    assert worst < 1e-12  # float64, same math on either side; only the order of the sums differs


@pytest.mark.parametrize("extra, message", [
    (["--n-heads", "3"], "--n-heads 3 does not divide --d-model 64; head counts that do: [1, 2, 4, 8, 16, 32, 64]"),
    (["--n-kv-heads", "3"], "--n-kv-heads 3 does not divide --n-heads 8; K/V head counts that do: [1, 2, 4, 8]"),
    (["--batch", "0"], "--batch must be at least 1 (got 0)"),
    (["--decode-steps", "-1"], "--decode-steps must be at least 0 (got -1)"),
    (["--timeout", "inf"], "--timeout must be a positive number of seconds, at most a day (got inf)"),
])
def test_sizes_no_layer_can_take_are_refused_with_one_line_and_status_2(extra, message):
    """Refused before torchrun's ranks start, so no rank fails in a traceback of its own."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "examples.tensor_parallel", *extra], cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [f"python -m examples.tensor_parallel: error: {message}"], proc.stderr
