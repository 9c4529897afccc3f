"""Case 5: peak resident memory of one forward, each measurement in a fresh process.

The child builds the layer and the input, resets the RSS high-water mark (Linux ``clear_refs``), reads its
current RSS (the baseline: inputs and weights), runs one forward under ``no_grad`` and reports the peak RSS
(``VmHWM``, or ``ru_maxrss`` where that is unavailable) minus the baseline: what the forward itself needed.
A fresh process per case keeps allocator caches and earlier peaks out of the number.

``headwise`` is the layer as shipped (long no-grad forwards run their queries in chunks, see
:mod:`headwise.chunking`); ``headwise one pass`` is the same layer with ``chunk_queries = False``.

Run one case by hand: ``python -m benchmarks.memory headwise 4096 32 128``.

Shapes:
    x: (1, s, h * d_h); the materialised probabilities a naive layer needs: (1, h, s, s).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

__all__ = ["measure", "IMPLS", "materialised_bytes"]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds the benchmarks package
IMPLS = ("headwise", "headwise one pass", "packed SDPA", "eager math")


def materialised_bytes(s: int, h: int, itemsize: int = 4) -> int:
    """Bytes of one (1, h, s, s) probability tensor (explicit math holds scores and probabilities).

    Example:
        >>> materialised_bytes(16384, 32) / 2**30    # what a naive layer needs at s 16384, h 32 (GiB)
        32.0
    """
    return h * s * s * itemsize


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    """Reset the kernel's RSS high-water mark (Linux: ``echo 5 > /proc/self/clear_refs``), so building the
    inputs (temporary copies included) does not count as the forward's peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    """The RSS high-water mark: VmHWM where readable (it honours :func:`_reset_peak`), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(impl: str, s: int, h: int, d_h: int) -> dict:
    import torch

    from headwise import MultiHeadAttention
    from benchmarks.peers import PackedSDPA

    torch.manual_seed(0)
    attn = MultiHeadAttention(h * d_h, h, backend="eager" if impl == "eager math" else "sdpa").eval()
    attn.chunk_queries = impl == "headwise"  # "headwise one pass": what the layer needs without query chunks
    layer = PackedSDPA(attn).eval() if impl == "packed SDPA" else attn
    if impl == "packed SDPA":
        del attn
    x = torch.randn(1, s, h * d_h)
    with torch.no_grad():  # warm the kernels (and the allocator) on a tiny input first
        layer(x[:, :8])
    import gc

    gc.collect()
    reset = _reset_peak()
    base = _rss_bytes()
    peak_before = _peak_bytes()
    t0 = time.perf_counter()
    with torch.no_grad():
        y = layer(x)
    seconds = time.perf_counter() - t0
    peak = _peak_bytes()
    return {"impl": impl, "s": s, "h": h, "d_head": d_h, "baseline_rss": base, "peak_rss": peak,
            "peak_before_forward": peak_before, "peak_reset": reset, "forward_peak_above_inputs": peak - base,
            "output_bytes": y.nbytes, "threads": torch.get_num_threads(), "forward_s": seconds,
            "query_chunk": _chunk_of(layer, x)}


def _chunk_of(layer, x) -> int | None:  # type: ignore[no-untyped-def]
    """Positions per query chunk the forward used (None: one pass; peers never chunk)."""
    import torch

    from headwise import MultiHeadAttention

    if not isinstance(layer, MultiHeadAttention):
        return None
    with torch.no_grad():
        return layer.explain_dispatch(x).query_chunk


def measure(impl: str, s: int, h: int, d_h: int, *, timeout: float = 900.0) -> dict:
    """Run one case in a child process; return its JSON result (or ``{"error": ...}``)."""
    cmd = [sys.executable, "-m", "benchmarks.memory", impl, str(s), str(h), str(d_h)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=_ROOT)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "s": s, "h": h, "d_head": d_h, "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"impl": impl, "s": s, "h": h, "d_head": d_h, "error": f"exit {proc.returncode}: {tail[0]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    impl_, s_, h_, d_h_ = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    if impl_ not in IMPLS:
        sys.exit(f"impl must be one of {IMPLS}, got {impl_!r}")
    print(json.dumps(_child(impl_, s_, h_, d_h_)))
