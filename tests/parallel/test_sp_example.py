"""The sequence-parallel torchrun example on 2 CPU ranks (gloo): a tiny difference from one process, and a
clear error within the configured timeout when a rank never joins."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.xdist_group("parallel"), pytest.mark.timeout(180)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(*extra: str, ranks: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "examples.sequence_parallel", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    root = Path(__file__).resolve().parents[2]  # examples/ lives at the repository root, beside src/
    return subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=root)


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
