"""What both torchrun examples do before and after their work: refuse to run outside torchrun, pick the
device (one CUDA device per local rank, NCCL; else CPU, gloo: one code path), start the process group with
the requested timeout, and always tear it down.

Shapes:
    none: process-group plumbing only.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Callable

import torch
import torch.distributed as dist


def under_torchrun(args: argparse.Namespace, module: str,
                   run: Callable[[argparse.Namespace, torch.device], int]) -> int:
    """``run(args, device)`` inside a process group (``args.backend``: "auto", "gloo" or "nccl";
    ``args.timeout``: seconds); exit status 2 with a one-line hint when not started by torchrun."""
    if "RANK" not in os.environ:
        print(f"run me under torchrun: torchrun --nproc-per-node 2 -m {module}", file=sys.stderr)
        return 2
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = args.backend == "nccl" or (args.backend == "auto" and torch.cuda.is_available()
                                         and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        status = run(args, device)
        # Every rank waits for the others before tearing down: a rank that destroys its group and exits while
        # a peer's gloo threads still hold the connection can abort that peer at exit.
        dist.barrier()
        return status
    finally:
        dist.destroy_process_group()
