"""The torchrun example runs on 2 CPU ranks (gloo) and reports a tiny difference from one process."""

from __future__ import annotations

import re
import subprocess

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
