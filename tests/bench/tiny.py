"""One benchmark case at the tiniest sizes, run in-process (the shared fixture body of the case tests)."""

from __future__ import annotations

from dataclasses import replace

import torch

from benchmarks import QUICK, resolve_only, run_suite

TINY = replace(QUICK, rounds=1, block_s=0.0)


def run_tiny(case: str) -> list[dict]:
    """The groups of ``case`` at :data:`TINY` sizes, on one thread (the caller's thread count restored)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_suite(TINY, resolve_only([case]), show=False)[0]
    finally:
        torch.set_num_threads(threads)
