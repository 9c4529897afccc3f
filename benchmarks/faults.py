"""One forward shape, the layer against the old code (:data:`benchmarks.baseline.BASELINE_REV`), in fresh
processes, with the page faults each call takes.

What a no-grad forward at b8 s512 d768 costs depends on the heap its process has built: glibc maps a large
block fresh (its pages fault in, zeroed, on first touch) or reuses one a previous call freed. A suite
process's heap is shaped by the groups before it, so this runs the one shape alone, in ``--processes``
fresh processes, both layers alternated round by round (the order flips every round), and prints per
process: each layer's median time, the median of the per-round ratios (new / old), and the median number
of minor page faults per call (``getrusage``) of each::

    python -m benchmarks.faults 8 512 768 12 --causal --processes 3

Shapes:
    b: batch, s: sequence, d: d_model, h: query heads, h_kv: key/value heads.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

import torch

from .baseline import layer_pair, load_baseline
from .timing import refresh_memory

__all__ = ["measure", "main"]


def measure(b: int, s: int, d: int, h: int, h_kv: int | None = None, *, causal: bool = False,
            rope: bool = False, rounds: int = 40) -> dict[str, float]:
    """Time the new and the old layer's no-grad forward on one ``(b, s, d)`` input, alternated.

    Returns the median times in ms (``new_ms``, ``old_ms``), the median per-round ratio (``ratio``) and the
    median minor page faults per call (``new_faults``, ``old_faults``).
    """
    old = load_baseline()
    if isinstance(old, str):
        raise SystemExit(f"benchmarks.faults: {old}")
    new, base = layer_pair(old, d, h, h_kv, rope=rope)
    refresh_memory(new, base)
    x = torch.randn(b, s, d)
    layers = {"new": new, "old": base}
    times: dict[str, list[float]] = {k: [] for k in layers}
    faults: dict[str, list[int]] = {k: [] for k in layers}
    ratios = []
    with torch.no_grad():
        for layer in layers.values():  # warm-up: kernels chosen, the heap built as a user's would be
            layer(x, causal=causal)
            layer(x, causal=causal)
        for r in range(rounds):
            for k in (("new", "old") if r % 2 == 0 else ("old", "new")):
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t = time.perf_counter()
                layers[k](x, causal=causal)
                times[k].append(time.perf_counter() - t)
                faults[k].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            ratios.append(times["new"][-1] / times["old"][-1])
    return {"new_ms": statistics.median(times["new"]) * 1e3, "old_ms": statistics.median(times["old"]) * 1e3,
            "ratio": statistics.median(ratios), "new_faults": statistics.median(faults["new"]),
            "old_faults": statistics.median(faults["old"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("shape", type=int, nargs=4, metavar=("B", "S", "D", "H"))
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (GQA); default: H")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--rope", action="store_true", help="the Llama-shaped layer (RoPE, no bias)")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--processes", type=int, default=1, help="fresh processes, one after another")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    flags = [f for f, on in (("--causal", args.causal), ("--rope", args.rope)) if on]
    if args.kv_heads is not None:
        flags += ["--kv-heads", str(args.kv_heads)]
    if args.child:
        m = measure(*args.shape, args.kv_heads, causal=args.causal, rope=args.rope, rounds=args.rounds)
        print(f"new {m['new_ms']:.1f} ms, old {m['old_ms']:.1f} ms, new/old {m['ratio']:.3f} "
              f"(median of {args.rounds} rounds); page faults per call: new {m['new_faults']:.0f}, "
              f"old {m['old_faults']:.0f}", flush=True)
        return 0
    print(f"b{args.shape[0]} s{args.shape[1]} d{args.shape[2]} h{args.shape[3]} {' '.join(flags)}".rstrip())
    for i in range(args.processes):
        cmd = [sys.executable, "-m", "benchmarks.faults", *map(str, args.shape), *flags,
               "--rounds", str(args.rounds), "--child"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            print(run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"process {i + 1} failed")
            return run.returncode
        print(f"process {i + 1}: {run.stdout.strip()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
