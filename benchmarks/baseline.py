"""Case "baseline": headwise now against headwise as it was when issues 14 and 15 were filed (commit
:data:`BASELINE_REV`, whose ``benchmarks/RESULTS.md`` is the "today's RESULTS.md" they measure against), both
imported into one process and timed side by side, interleaved, on identical weights and inputs.

Why not compare with the old RESULTS.md directly: on this shared virtual machine the absolute time of code that
did not change moves by more than the 2 % the issues allow between two runs (the matmul-peak rows, pure
PyTorch, moved 0.80x-1.11x between two runs of one afternoon). A regression is a property of the code, so the
old code is measured again, next to the new, in the same process: the ratio is then read like every other
paired ratio of the suite, and with ``--processes N`` it is the median of N per-process ratios.

The old package comes from git (``git archive BASELINE_REV src/headwise``), unpacked once into the temporary
folder and imported under another name (``headwise_ea85a5a``; it imports itself only relatively). Without that
commit in the checkout's history (a shallow clone, an exported tree) the case has no groups and says why.

Groups: the forward shapes of case 1 (full and causal, the plain and the Llama-shaped layer), fwd+bwd at
b8 s512 d768, the GQA forward, per-head weights, one-token decode with a KV cache at the decode shapes
(the old layer also with its opt-in packed GEMM, the path issue 14 removed), and the patched Hugging Face
models of case 7 (patched by the old ``interop.patch`` against the new one).

Shapes:
    b: batch, s: sequence, d: d_model, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

import copy
import importlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from headwise import MultiHeadAttention, RotaryEmbedding

from .processes import ROOT
from .timing import Entry, Group, forward_flops, refresh_memory

__all__ = ["BASELINE_REV", "BASE", "baseline_groups", "layer_pair", "load_baseline"]

#: main when issues 14 and 15 were filed (2026-11-30 11:25 UTC, the last commit before them).
BASELINE_REV = "ea85a5a16f3bd2e978b7ba62332d982f8ed52416"
#: The name of the old layer's entries; the new layer's are named as in the other cases.
BASE = f"headwise at {BASELINE_REV[:7]}"


def load_baseline(rev: str = BASELINE_REV) -> ModuleType | str:
    """The ``headwise`` package of commit ``rev``, imported as ``headwise_<rev[:7]>``, or the reason it cannot be.

    Example:
        >>> old = load_baseline()
        >>> isinstance(old, str) or old.__name__ == f"headwise_{BASELINE_REV[:7]}"
        True
    """
    name = f"headwise_{rev[:7]}"
    if name in sys.modules:
        return sys.modules[name]
    root = Path(tempfile.gettempdir()) / f"headwise-baseline-{rev[:12]}"
    if not (root / name / "__init__.py").exists():
        try:
            tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "src/headwise"],
                                 capture_output=True, check=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            err = getattr(exc, "stderr", b"") or b""
            return f"commit {rev[:7]} is not in this checkout's git history ({err.decode(errors='replace').strip() or exc})"
        root.mkdir(parents=True, exist_ok=True)
        unpack = Path(tempfile.mkdtemp(prefix="unpack-", dir=root))
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            t.extractall(unpack, filter="data")
        try:
            os.rename(unpack / "src" / "headwise", root / name)
        except OSError:  # another benchmark process unpacked it first
            pass
        shutil.rmtree(unpack, ignore_errors=True)
    if str(root) not in sys.path:
        sys.path.append(str(root))
    return importlib.import_module(name)


def layer_pair(old: ModuleType, d: int, h: int, h_kv: int | None = None, *, rope: bool = False):  # type: ignore[no-untyped-def]
    """A new layer and the old layer with the same weights (the state-dict layout did not change)."""
    torch.manual_seed(0)
    new = MultiHeadAttention(d, h, h_kv, bias=not rope, rotary=RotaryEmbedding(d // h) if rope else None).eval()
    base = old.MultiHeadAttention(d, h, h_kv, bias=not rope,
                                  rotary=old.RotaryEmbedding(d // h) if rope else None).eval()
    base.load_state_dict(new.state_dict())
    return new, base


def _no_grad(f: Callable, *args, **kwargs) -> Callable[[], object]:
    def g():  # type: ignore[no-untyped-def]
        with torch.no_grad():
            return f(*args, **kwargs)
    return g


def _both(make: Callable[[MultiHeadAttention], Callable[[], object]], new, base, label: str = "") -> list[Entry]:  # type: ignore[no-untyped-def]
    name = f"headwise{label}"
    return [Entry(name, make(new), role="headwise" if not label else "headwise2"),
            Entry(f"{BASE}{label}", make(base), ref=name)]


def _layer_group(old, sz, case: str, shape, causal: bool, mode: str) -> Group:  # type: ignore[no-untyped-def]
    b, s, d, h = shape
    plain, plain_b = layer_pair(old, d, h)
    rope, rope_b = layer_pair(old, d, h, rope=True)
    x = torch.randn(b, s, d, requires_grad=mode == "fwd+bwd")
    if mode == "fwd+bwd":
        grad = torch.randn(b, s, d)
        for m in (plain, plain_b, rope, rope_b):
            m.train()
        make = lambda m: (lambda: torch.autograd.grad(m(x, causal=causal), [x, *m.parameters()], grad))  # noqa: E731
    else:
        make = lambda m: _no_grad(m, x, causal=causal)  # noqa: E731
    es = _both(make, plain, plain_b) + _both(make, rope, rope_b, " (RoPE, no bias)")
    refresh_memory(plain, plain_b, rope, rope_b)
    flops = forward_flops(b, s, d, d, d, causal) * (3 if mode == "fwd+bwd" else 1)
    return Group(f"baseline {case}", f"{mode} b{b} s{s} d{d} h{h} {'causal' if causal else 'full'}", es,
                 rounds=_rounds(sz, flops), block_s=sz.block_s, tol=(5e-4, 5e-5), flops=flops,
                 meta={"b": b, "s": s, "d": d, "h": h, "causal": causal, "mode": mode})


def _rounds(sz, flops: float) -> int:  # type: ignore[no-untyped-def]
    # Two entries per layer shape: twice the rounds the cases with many peers use, at the same cost.
    heavy = flops >= sz.heavy_flops
    return 2 * (sz.heavy_rounds if heavy else sz.rounds)


def _gqa_group(old, sz) -> Group:  # type: ignore[no-untyped-def]
    s, d, h, kvs = sz.gqa
    new, base = layer_pair(old, d, h, kvs[0])
    x = torch.randn(1, s, d)
    refresh_memory(new, base)
    flops = forward_flops(1, s, d, d, d * kvs[0] // h)
    return Group("baseline 2 GQA/MQA", f"GQA forward s{s} d{d} h{h} h_kv{kvs[0]}",
                 _both(lambda m: _no_grad(m, x), new, base), rounds=_rounds(sz, flops), block_s=sz.block_s,
                 tol=(2e-4, 2e-5), flops=flops, meta={"s": s, "d": d, "h": h, "h_kv": kvs[0], "mode": "forward"})


def _weights_group(old, sz) -> Group:  # type: ignore[no-untyped-def]
    b, s, d, h = sz.weights[0]
    new, base = layer_pair(old, d, h)
    x = torch.randn(b, s, d)
    refresh_memory(new, base)
    flops = forward_flops(b, s, d, d, d)
    return Group("baseline 3 per-head weights", f"weights b{b} s{s} d{d} h{h}",
                 _both(lambda m: _no_grad(m, x, return_weights=True), new, base), rounds=_rounds(sz, flops),
                 block_s=sz.block_s, tol=(2e-4, 2e-5), flops=flops, meta={"b": b, "s": s, "d": d, "h": h})


def _fill(cache, k: torch.Tensor, v: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    cache.reset()
    cache.update(k, v)


def _decode_group(old, sz, d: int, h: int, h_kv: int, ctx: int) -> Group:  # type: ignore[no-untyped-def]
    n = sz.decode_tokens
    max_len = ctx + n * (4 * sz.rounds + 4) + 8
    new, base = layer_pair(old, d, h, h_kv)
    twin = old.MultiHeadAttention(d, h, h_kv).eval()  # the old layer again, for its packed-GEMM opt-in
    twin.load_state_dict(base.state_dict())
    caches = [m.new_cache(1, max_len) for m in (new, base, twin)]
    refresh_memory(new, base, twin, *caches)
    packed = old.packed_gemm.available()
    if packed:
        twin.use_packed_gemm(rows=1)  # the old opt-in: packs its own copy of the weights
    torch.manual_seed(ctx)
    k0, v0 = torch.randn(1, h_kv, ctx, d // h), torch.randn(1, h_kv, ctx, d // h)
    x = torch.randn(1, 1, d)
    es = [Entry("headwise", _no_grad(new, x, cache=caches[0]), role="headwise", number=n,
                reset=partial(_fill, caches[0], k0, v0)),
          Entry(BASE, _no_grad(base, x, cache=caches[1]), ref="headwise", number=n,
                reset=partial(_fill, caches[1], k0, v0))]
    notes = []
    if packed:
        es.append(Entry(f"{BASE} use_packed_gemm", _no_grad(twin, x, cache=caches[2]), ref="headwise", number=n,
                        reset=partial(_fill, caches[2], k0, v0),
                        note="the old opt-in packed-GEMM decode (removed by issue 14): not part of the goal"))
    else:
        notes.append("the old packed GEMM is not available in this torch build")
    return Group("baseline 4 decode", f"decode d{d} h{h} h_kv{h_kv} context {ctx}", es, rounds=4 * sz.rounds,
                 tol=(2e-4, 2e-5), meta={"d": d, "h": h, "h_kv": h_kv, "context": ctx, "tokens_per_round": n},
                 notes=notes)


def _patched_group(old, sz, family: str, mode: str) -> Group:  # type: ignore[no-untyped-def]
    from headwise.interop import patch

    from . import patched as p

    quick = sz.rounds < 5
    spec = {"Llama": p.QUICK_LLAMA if quick else p.LLAMA, "GPT-2": p.QUICK_GPT2 if quick else p.GPT2}[family]
    plain = (p.llama_model if family == "Llama" else p.gpt2_model)(spec)
    new = patch(copy.deepcopy(plain))
    base = old.interop.patch(copy.deepcopy(plain))
    del plain
    refresh_memory(new, base)
    if mode == "forward":
        b, s = (1, 8) if quick else (4, 256)
        ids = torch.randint(1, spec[-1], (b, s), generator=torch.Generator().manual_seed(1))
        es = _both(lambda m: partial(p.forward_logits, m, ids), new, base)
        name, rounds, tol, meta = f"patched {family} forward b{b} s{s}", 2 * sz.rounds, (1e-4, 1e-4), {"b": b, "s": s}
    else:
        s, k = (4, 4) if quick else (64, 32)
        ids = torch.randint(1, spec[-1], (1, s), generator=torch.Generator().manual_seed(2))
        es = _both(lambda m: partial(p.greedy, m, ids, k), new, base)
        for e in es:
            e.number = 1
        name, rounds, tol, meta = f"patched {family} generate {k} tokens from {s}", 4 * sz.rounds, (0.0, 0.0), {"s": s}
    return Group("baseline 7 patched", name, es, rounds=rounds, block_s=sz.block_s, tol=tol,
                 meta={"model": family, "mode": mode, **meta})


def baseline_groups(sz) -> list[Callable[[], Group]]:  # type: ignore[no-untyped-def]
    """The groups of this case, or none (with the reason on stderr) when the old package cannot be loaded."""
    old = load_baseline()
    if isinstance(old, str):
        print(f"baseline case skipped: {old}", file=sys.stderr)
        return []
    from .peers import hf_available

    out: list[Callable[[], Group]] = [partial(_layer_group, old, sz, "1 forward", shape, causal, "forward")
                                      for shape in sz.forward for causal in (False, True)]
    out += [partial(_layer_group, old, sz, "1 fwd+bwd", sz.backward[0], causal, "fwd+bwd") for causal in (False, True)]
    out += [partial(_gqa_group, old, sz), partial(_weights_group, old, sz)]
    d, h, kvs, contexts = sz.decode
    out += [partial(_decode_group, old, sz, d, h, h_kv, contexts[-1]) for h_kv in kvs]
    d, h, ctx = sz.decode_xw
    out.append(partial(_decode_group, old, sz, d, h, h, ctx))
    if hf_available() is None:
        out += [partial(_patched_group, old, sz, fam, mode) for mode in ("forward", "generate")
                for fam in ("Llama", "GPT-2")]
    return out
