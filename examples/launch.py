"""What both torchrun examples do before and after their work: refuse sizes no layer can take (one line, status
2, before torchrun's ranks each fail alike in a traceback), refuse to run outside torchrun, pick the
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

from headwise.config import valid_head_counts

#: The least value of each size option an example may have (absent options are skipped).
_LEAST = {"d_model": 1, "n_heads": 1, "n_kv_heads": 1, "batch": 1, "seq_len": 1, "decode_steps": 0, "tp": 1}


def check_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace, *, rotary: bool = False) -> None:
    """Exit with status 2 and one line when the sizes cannot make the example's layer and inputs.

    Args:
        parser: the example's parser (its ``prog`` starts the line).
        args: the parsed options (``d_model``, ``n_heads``, ``n_kv_heads``, ``timeout``, and any of ``batch``,
            ``seq_len``, ``decode_steps``, ``tp``).
        rotary: the layer has rotary positions, which rotate pairs of features: the head width must be even.
    """
    def refuse(message: str) -> None:
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    for name, least in _LEAST.items():
        value = getattr(args, name, least)
        if value < least:
            refuse(f"--{name.replace('_', '-')} must be at least {least} (got {value})")
    if not 0 < args.timeout <= 86400:  # also refuses nan and inf (timedelta takes no infinite seconds)
        refuse(f"--timeout must be a positive number of seconds, at most a day (got {args.timeout})")
    d, h, h_kv = args.d_model, args.n_heads, args.n_kv_heads
    if d % h:
        refuse(f"--n-heads {h} does not divide --d-model {d}; head counts that do: {valid_head_counts(d)}")
    if h % h_kv:
        refuse(f"--n-kv-heads {h_kv} does not divide --n-heads {h}; K/V head counts that do: {valid_head_counts(h)}")
    if rotary and (d // h) % 2:
        refuse(f"rotary positions need an even head width; --d-model {d} / --n-heads {h} gives {d // h}")


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
        # a peer's gloo threads still hold the connection can abort that peer at exit. After a failure a peer
        # may never arrive (it hangs or already stopped): waiting would only add a second, raw timeout.
        if status == 0:
            dist.barrier()
        return status
    finally:
        dist.destroy_process_group()
