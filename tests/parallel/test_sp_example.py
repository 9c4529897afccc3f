"""The sequence-parallel torchrun example on 2 CPU ranks (gloo): a tiny difference from one process, and a
clear error within the configured timeout when a rank never joins."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel.spawn import torchrun

pytestmark = [pytest.mark.xdist_group("parallel"), pytest.mark.timeout(180)]


def _run(*extra: str, ranks: int = 2) -> subprocess.CompletedProcess:
    return torchrun("examples.sequence_parallel", *extra, ranks=ranks)


def test_torchrun_example_reports_slices_heads_and_a_tiny_difference():
    proc = _run("--dtype", "float64", "--seq-len", "25", "--timeout", "60")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "rank 0/2: tokens [0, 13) of 25, heads [0, 1, 2, 3]" in out
    assert "rank 1/2: tokens [13, 25) of 25, heads [4, 5, 6, 7]" in out
    per_rank = [float(v) for v in re.findall(r"(?:forward|gradients) ([0-9.e+-]+)", out)]
    assert len(per_rank) == 4
    worst = float(re.search(r"all ranks\): ([0-9.e+-]+)", out).group(1))
    assert worst == max(per_rank) and worst < 1e-12


def test_four_ranks_with_one_kv_head_and_a_2d_mesh():
    for extra, heads in ((["--n-kv-heads", "1", "--seq-len", "30"], "rank 3/4: tokens [23, 30) of 30, heads [6, 7]"),
                         (["--tp", "2"], "rank 3/4: tokens [13, 25) of 25, heads [6, 7]")):
        proc = _run("--dtype", "float64", "--timeout", "60", *extra, ranks=4)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert heads in proc.stdout
        worst = float(re.search(r"all ranks\): ([0-9.e+-]+)", proc.stdout).group(1))
        assert worst < 1e-12


def test_a_rank_that_hangs_gives_a_clear_error_after_the_configured_timeout():
    proc = _run("--timeout", "3", "--hang-rank", "1")
    assert proc.returncode != 0
    assert re.search(r"rank 0: error: sequence_parallel: .* over 2 ranks did not complete within the process "
                     r"group's timeout", proc.stderr), proc.stderr[-2000:]
    # The one-line error is the whole story from the ranks: no second, raw gloo timeout from a rank's teardown
    # (torchrun's own summary of the failed worker follows, with its own lines, none prefixed by a rank).
    rank_lines = [line for line in proc.stderr.splitlines() if line.startswith("[rank")]
    assert rank_lines == [], "\n".join(rank_lines[-20:])


def test_sequences_shorter_than_the_padding_run_and_match_one_process():
    """--seq-len 1 and 2 (the example pads the first sample by 3 tokens): still one unpadded token, and rank 1
    holds no token at all at --seq-len 1."""
    for s in (1, 2):
        proc = _run("--dtype", "float64", "--seq-len", str(s), "--timeout", "60")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert f"rank 1/2: tokens [1, {s}) of {s}, heads [4, 5, 6, 7]" in proc.stdout
        worst = float(re.search(r"all ranks\): ([0-9.e+-]+)", proc.stdout).group(1))
        assert worst < 1e-12


def test_an_empty_sequence_is_refused_with_one_line_and_status_2():
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "examples.sequence_parallel", "--seq-len", "0"], cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == ["python -m examples.sequence_parallel: error: --seq-len must be at least 1 "
                                        "(got 0)"], proc.stderr


@pytest.mark.parametrize("extra, message", [
    (["--n-heads", "3"], "--n-heads 3 does not divide --d-model 64; head counts that do: [1, 2, 4, 8, 16, 32, 64]"),
    (["--n-kv-heads", "3"], "--n-kv-heads 3 does not divide --n-heads 8; K/V head counts that do: [1, 2, 4, 8]"),
    (["--n-heads", "64"], "rotary positions need an even head width; --d-model 64 / --n-heads 64 gives 1"),
    (["--batch", "0"], "--batch must be at least 1 (got 0)"),
    (["--tp", "0"], "--tp must be at least 1 (got 0)"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds, at most a day (got 0.0)"),
])
def test_sizes_no_layer_can_take_are_refused_with_one_line_and_status_2(extra, message):
    """Refused before torchrun's ranks start, so no rank fails in a traceback of its own."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "examples.sequence_parallel", *extra], cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [f"python -m examples.sequence_parallel: error: {message}"], proc.stderr
