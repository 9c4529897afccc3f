"""Process groups for the parallel tests: a free port, every scenario of a worker on ``world`` ranks, one
rank's session, and torchrun of an example."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.multiprocessing as mp

JOIN_TIMEOUT_S = 150.0
#: What libstdc++ prints when a process aborts because a thread object was destroyed while still joinable.
TEARDOWN_ABORT = "terminate called without an active exception"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(run_rank: Callable[..., None], world: int) -> list[dict]:
    """Run ``run_rank(rank, world, port, folder)`` on ``world`` ranks and load what each rank saved as
    ``rank{r}.pt``; a hard deadline kills the ranks instead of hanging."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(run_rank, args=(world, free_port(), tmp), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    pytest.fail(f"{world}-rank group did not finish within {JOIN_TIMEOUT_S} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def rank_session(rank: int, world: int, port: int, out_dir: str, timeout_s: float,
                 cases: Callable[[dict], None]) -> None:
    """One spawned rank: one thread, a gloo group on loopback, ``cases(results)`` filling the dict that is saved
    as ``rank{r}.pt`` for :func:`spawn` (with the traceback when a case raised), the group destroyed."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    if sys.platform.startswith("linux") and Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own connections stay on loopback
    results: dict = {}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        cases(results)
    except BaseException:
        results["traceback"] = traceback.format_exc()
        raise
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()


def torchrun(module: str, *extra: str, ranks: int = 2, timeout: float = 150.0) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node ranks -m module extra...`` on CPU from the repository root (where examples/
    lives), one thread per rank, gloo on loopback."""
    def cmd() -> list[str]:  # a fresh port for every run
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
                "127.0.0.1", "--master-port", str(free_port()), "-m", module, *extra]

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own connections stay on loopback
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(cmd(), capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    if proc.returncode != 0 and TEARDOWN_ABORT in proc.stderr and "Traceback" not in proc.stdout:
        # A rank of this PyTorch build can abort in C++ teardown after its work, output and group teardown are
        # done (a thread still joinable at exit; seldom, under a loaded CI machine, never on demand). That is
        # not the example's result, so the run is repeated once; any other failure, or a second abort, stands.
        proc = subprocess.run(cmd(), capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    return proc
