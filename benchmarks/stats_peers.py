"""Per-head statistics at long context with the peers: how long a sequence each tool can answer "entropy, max
weight and key weight of every head of every layer" for, and at what time and peak memory.

``python -m benchmarks.stats_peers [--lengths 2048,4096,8192] [--limit-gib 20]``: a GPT-2-small-shaped model
(d768 h12, 4 layers, random weights, ``n_positions`` 8192), each (tool, length) in a fresh process whose address
space is capped at ``--limit-gib`` (a tool that needs more fails there with an allocation error instead of taking
the machine's memory from its other users). Tools:

* ``plain``: a forward of the unpatched model (sdpa), no capture: the reference time and memory;
* ``headwise``: ``headwise.trace(patched, capture=("lse", "entropy", "max_weight", "key_weight"))``;
* ``transformer_lens``: ``HookedTransformer.run_with_cache`` of every layer's ``hook_pattern``, the three
  statistics computed from the cached patterns;
* ``nnsight``: ``NNsight(eager model).trace`` saving every layer's attention weights (``output_attentions``),
  the same three statistics from them.

Each process runs its tool once at s 256 (imports, first-call allocations), then measures one call: seconds and
the peak resident memory above the level before the call (:func:`benchmarks.timing.peak_rss_above`). A table in
Markdown goes to stdout.

Shapes:
    ids (1, s); patterns (1, h, s, s) per layer; statistics (1, h, s).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any, Callable

import torch

__all__ = ["main", "measure"]

TOOLS = ("plain", "headwise", "transformer_lens", "nnsight")
D, H, LAYERS, VOCAB, POSITIONS = 768, 12, 4, 50257, 8192


def _from_patterns(patterns: list[torch.Tensor]) -> list[torch.Tensor]:
    """Entropy, max weight and key weight of each layer's (1, h, s, s) pattern, as a user computes them."""
    out = []
    for p in patterns:
        out += [-(p * p.clamp_min(1e-30).log()).sum(-1), p.amax(-1), p.sum(-2)]
    return out


def _tool(name: str) -> Callable[[torch.Tensor], Any]:
    """A one-argument call of ``name`` on token ids, built once (models, wrappers)."""
    import copy

    import transformers

    import headwise
    from headwise.interop import patch

    from .trace import _transformer_lens

    cfg = transformers.GPT2Config(n_embd=D, n_head=H, n_layer=LAYERS, vocab_size=VOCAB, n_positions=POSITIONS,
                                  bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, attn_implementation="sdpa")
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(cfg).eval()
    if name == "plain":
        return lambda ids: lm.transformer(input_ids=ids).last_hidden_state
    if name == "headwise":
        model = patch(copy.deepcopy(lm.transformer))
        stats = ("lse", "entropy", "max_weight", "key_weight")

        def run(ids: torch.Tensor) -> list[torch.Tensor]:
            with headwise.trace(model, capture=stats) as t:
                model(input_ids=ids)
            return [getattr(r, s) for r in t for s in stats]
        return run
    if name == "transformer_lens":
        tl = _transformer_lens(lm)
        names = [f"blocks.{i}.attn.hook_pattern" for i in range(LAYERS)]

        def run(ids: torch.Tensor) -> list[torch.Tensor]:
            _, cache = tl.run_with_cache(ids, names_filter=names, stop_at_layer=LAYERS)
            return _from_patterns([cache[n] for n in names])
        return run
    if name == "nnsight":
        from nnsight import NNsight

        eager = copy.deepcopy(lm.transformer)
        eager.set_attn_implementation("eager")
        model = NNsight(eager)

        def run(ids: torch.Tensor) -> list[torch.Tensor]:
            saved = []
            with model.trace(input_ids=ids, output_attentions=True):
                for blk in model.h:
                    saved.append(blk.attn.output[1].save())
            return _from_patterns([s.value if hasattr(s, "value") else s for s in saved])
        return run
    raise ValueError(f"tool must be one of {TOOLS}, got {name!r}")


def measure(name: str, s: int) -> dict:
    """One call of tool ``name`` at length ``s`` after a warm-up at 256: seconds and peak bytes."""
    from .timing import peak_rss_above

    fn = _tool(name)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        fn(torch.randint(0, VOCAB, (1, 256), generator=g))
        ids = torch.randint(0, VOCAB, (1, s), generator=g)
        seconds: list[float] = []

        def timed() -> Any:  # the clock inside: peak_rss_above collects garbage and trims the heap first
            t0 = time.perf_counter()
            out = fn(ids)
            seconds.append(time.perf_counter() - t0)
            return out

        peak = peak_rss_above(timed)
    return {"tool": name, "s": s, "seconds": seconds[0], "peak_bytes": peak}


def _child(name: str, s: int, limit_gib: float) -> dict:
    def cap() -> None:
        limit = int(limit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    done = subprocess.run([sys.executable, "-m", "benchmarks.stats_peers", "--one", name, str(s)],
                          capture_output=True, text=True, preexec_fn=cap, timeout=3600)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["exit code " + str(done.returncode)])[-1]
        return {"tool": name, "s": s, "failed": tail[:160]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stats_peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096,6144,8192")
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--limit-gib", type=float, default=20.0)
    p.add_argument("--one", nargs=2, metavar=("TOOL", "S"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]))))
        return 0
    rows = []
    for name in args.tools.split(","):
        for s in (int(x) for x in args.lengths.split(",")):
            r = _child(name, s, args.limit_gib)
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
            if "failed" in r:
                break  # a longer sequence needs more
    print(f"| tool | s | seconds | peak MiB | (address space capped at {args.limit_gib:g} GiB) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        if "failed" in r:
            print(f"| {r['tool']} | {r['s']} | failed | | {r['failed']} |")
        else:
            print(f"| {r['tool']} | {r['s']} | {r['seconds']:.2f} | {r['peak_bytes'] / 2**20:.0f} | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
