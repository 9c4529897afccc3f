"""``headwise compare``: the costs of several published configurations side by side."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..analysis import dtype_info, summarize
from ..analysis.memory import DTYPE_NAMES
from ..presets import PRESETS, get_preset
from . import CliError
from . import format as fmt
from ._sizes import human_bytes, human_count, size


DEFAULTS = {"seq": 4096, "batch": 1, "dtype": "float16"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="costs of published configurations side by side (e.g. MHA vs GQA KV cache)")
    p.add_argument("presets", nargs="*", metavar="PRESET", help=f"preset names: {', '.join(PRESETS)}")
    p.add_argument("--list", action="store_true", help="list the presets with their citations")
    # None: not given (--list refuses what it would ignore); the defaults are DEFAULTS'
    p.add_argument("--seq", type=size, default=None, help=f"context length (default {DEFAULTS['seq']})")
    p.add_argument("--batch", type=size, default=None, help=f"(default {DEFAULTS['batch']})")
    p.add_argument("--dtype", default=None,
                   help=f"storage dtype (default {DEFAULTS['dtype']}; one of {sorted(DTYPE_NAMES)})")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run)


def compare(names: list[str], seq: int, batch: int, dtype: str) -> list[dict[str, Any]]:
    try:
        dt, _ = dtype_info(dtype)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    out = []
    for name in names:
        p = get_preset(name)
        out.append({"preset": p.to_dict()} | summarize(p.config, seq, batch=batch, dtype=dt, n_layers=p.n_layers,
                                                         sliding_window=p.sliding_window))
    return out


def kv_cache_cell(r: dict[str, Any]) -> str:
    """The KV cache of the whole sequence; "(window W)" where a sliding window keeps fewer positions."""
    kv = r["kv_cache"]
    window = f" (window {kv['sliding_window']})" if kv["positions"] < r["seq_len"] else ""
    return human_bytes(kv["context_bytes"]) + window


def length_note(seq: int, preset: dict[str, Any]) -> str | None:
    """A note (not a refusal: the figures are arithmetic) when ``seq`` is past the preset's position limit."""
    limit = preset["max_positions"]
    if limit is None or seq <= limit:
        return None
    return (f"{seq} tokens is past the {limit} positions {preset['name']} takes (its position limit); its figures "
            "are computed all the same")


ROWS = [
    ("kind", lambda r: r["config"]["kind"]),
    ("d_model", lambda r: r["config"]["d_model"]),
    ("n_heads / n_kv_heads", lambda r: f"{r['config']['n_heads']} / {r['config']['n_kv_heads']}"),
    ("d_head", lambda r: r["config"]["d_head"]),
    ("layers", lambda r: r["n_layers"]),
    ("attn params / layer", lambda r: human_count(r["params"]["layer"]["total"])),
    ("attn params, all layers", lambda r: human_count(r["params"]["all_layers"])),
    ("FLOPs / layer, proj + attn", lambda r: f"{human_count(r['flops']['layer']['projections'], 'FLOP')} + "
                                                 f"{human_count(r['flops']['layer']['attention'], 'FLOP')}"),
    ("KV cache / token", lambda r: human_bytes(r["kv_cache"]["per_token_bytes"])),
    ("KV cache / 1k tokens", lambda r: human_bytes(r["kv_cache"]["per_1k_tokens_bytes"])),
    ("KV cache, seq x batch", kv_cache_cell),
    ("probs / layer, eager", lambda r: human_bytes(r["probabilities"]["materialised"])),
    ("probs / layer, fused", lambda r: human_bytes(r["probabilities"]["fused"])),
]


def run(args: argparse.Namespace) -> int:
    given = [f"--{k}" for k in DEFAULTS if getattr(args, k) is not None]
    if args.list and (args.presets or given):  # a listing would silently drop them
        extra = ", ".join([*args.presets, *given])
        raise CliError(f"--list lists every preset and takes no presets, --seq, --batch or --dtype, got {extra}; "
                       "drop --list to compare the presets named")
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    if args.list:
        listing = [PRESETS[n].to_dict() for n in PRESETS]
        if args.json:
            fmt.emit_json(listing)
        else:
            fmt.table("Presets", ["name", "model", "d_model", "h / h_kv", "d_head", "layers", "rope theta"],
                      [(p["name"], p["title"], p["config"]["d_model"],
                        f"{p['config']['n_heads']} / {p['config']['n_kv_heads']}", p["config"]["d_head"],
                        p["n_layers"], p["rope_theta"] or "-") for p in listing], optional=["rope theta"])
            fmt.line("Sources:")
            for p in listing:
                fmt.line(f"  {p['name']}: {p['citation']}")
        return 0
    if not args.presets:
        raise CliError(f"name at least one preset (or --list); known: {', '.join(PRESETS)}")
    results = compare(args.presets, args.seq, args.batch, args.dtype)
    for r in results:
        note = length_note(r["seq_len"], r["preset"])
        if note:
            print(f"headwise compare: note: {note}", file=sys.stderr)
    if args.json:
        fmt.emit_json(results)
        return 0
    r0 = results[0]
    fmt.table(f"Per model: {r0['seq_len']} tokens, batch {r0['batch']}, {r0['dtype']}",
              ["", *[r["preset"]["name"] for r in results]],
              [(label, *[get(r) for r in results]) for label, get in ROWS])
    fmt.line("probs = attention probabilities (b, h, s, s) held by the eager path; the fused path keeps one "
             "log-sum-exp per (b, h, query).")
    if any(r["kv_cache"]["positions"] < r["seq_len"] for r in results):
        fmt.line("window W = a sliding-window model: each layer attends to, and caches, only the last W positions.")
    fmt.line("Sources:")
    for r in results:
        fmt.line(f"  {r['preset']['name']}: {r['preset']['citation']}")
    return 0
