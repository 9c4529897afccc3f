"""``headwise heads --stats``: every layer x head of a model at long context, from per-head statistics (no pattern
is materialised, so any length the model takes is served): mean entropy, mean max weight and first-token share of
every head (a table, a PNG grid or an HTML page), the sink and sharp heads named, and per-position curves of
chosen heads (``--curves 0.3,5.7``; default: the strongest sink, the sharpest and the most spread head).

Length is limited only by the model's position embeddings; the statistics hold no ``s x s`` array."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import CliError, require
from . import format as fmt
from ._output import check_out, save
from ._progress import steps


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """``"0.3,5.7"`` -> ``[(0, 3), (5, 7)]`` ((layer, head) pairs, in order, without repeats)."""
    out: list[tuple[int, int]] = []
    for part in text.split(","):
        layer, dot, head = part.strip().partition(".")
        try:
            pair = (int(layer), int(head))
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be layer.head pairs such as 0.3,5.7, got {text!r}") from None
        if not dot or min(pair) < 0:
            # worded "must be ..." as the error above, so the parser shows both as "--curves must be ..."
            raise argparse.ArgumentTypeError(f"must be layer.head pairs of non-negative numbers such as 0.3,5.7, "
                                             f"got {part.strip()!r}" + (f" in {text!r}" if part != text else ""))
        if pair not in out:
            out.append(pair)
    return out


def check_stats_args(args: argparse.Namespace, info: Any) -> Path | None:
    """The ``--stats`` arguments against the model's config.json, before anything loads; the out path."""
    if args.layer is not None or args.all_layers or args.heads is not None:
        raise CliError("--stats draws every layer and head; choose heads for the per-position curves with --curves "
                       "LAYER.HEAD,... (not --layer, --all-layers or --heads)")
    from ..viz.numbers import span

    for layer, head in args.curves or ():
        if layer >= info.n_layers:
            raise CliError(f"--curves: layer must be in [0, {info.n_layers}) for this {info.n_layers}-layer model, "
                           f"got {layer}.{head}")
        labels = info.labels_of(layer)  # after head surgery: the heads' numbers before it, as the table shows
        if labels is None and head >= info.heads_of(layer)[0]:
            raise CliError(f"--curves: layer {layer} has {fmt.plural(info.heads_of(layer)[0], 'head')}, got "
                           f"{layer}.{head}")
        if labels is not None and head not in labels:
            raise CliError(f"--curves: layer {layer} has no head {head}: head surgery " + (
                f"left its heads {span(sorted(labels))} (numbered as before surgery)" if labels
                else "removed every head of it"))
    if args.out is None:
        return None
    out = check_out(args.out, (".png", ".html", ".htm"))
    if out.suffix.lower() == ".png":
        require("matplotlib", "headwise heads --stats --out FILE.png")
    return out


def run_stats(args: argparse.Namespace, info: Any, out: Path | None, load: Any) -> int:
    """Load (``load(step)`` returns the model inputs, tokens, patched model and the text's tokens before the
    cut), trace the statistics, then print the table, the JSON (a cut text: ``"truncated": true`` and
    ``"text_tokens"``, as ``heads --json`` has), or say where the picture is."""
    with steps(4 if out else 3, enabled=not args.json) as step:
        step("importing torch and transformers")
        from ..surgery.hosts import quiet
        from ..viz.statistics import model_statistics

        with quiet():
            enc, tokens, model, n_tokens = load(step)
            step(f"running every layer ({len(tokens)} tokens): per-head statistics, no pattern")
            stats = model_statistics(model, enc, tokens=tokens, name=info.name)
        try:  # heads the sidecar did not give
            stats.check_pairs(args.curves or [])
        except ValueError as exc:
            raise CliError(f"--curves: {exc}") from None
        if out is not None:
            step(f"drawing {out}")
            title = f"headwise: {info.name}, every head, {fmt.plural(len(tokens), 'token')} (statistics, no pattern)"
            if out.suffix.lower() == ".png":
                from ..viz.stats_png import save_statistics_png

                save(out, lambda tmp: save_statistics_png(stats, tmp, heads=args.curves, title=title))
            else:
                from ..viz.stats_html import save_statistics_html

                save(out, lambda tmp: save_statistics_html(stats, tmp, heads=args.curves, title=title))
    pairs = stats.pairs()
    heads = f" x {fmt.plural(stats.n_heads, 'head')}" if stats.heads is None else \
        f", {fmt.plural(len(pairs), 'head')} (after head surgery)"
    what = f"{info.name}, {fmt.plural(stats.n_layers, 'layer')}{heads}, {fmt.plural(len(tokens), 'token')}"
    if args.json:
        fmt.emit_json({"model": info.name, "family": info.family, "out": None if out is None else str(out),
                       "text_tokens": n_tokens, "truncated": n_tokens > len(tokens), **stats.to_dict()})
        return 0
    if out is not None:
        fmt.line(f"Wrote {out} ({what}; per-head statistics, no pattern)")
        return 0
    grid, kinds = stats.grid(), stats.kinds()
    label = {p: k for k in ("sharp", "sink") for p in kinds[k]}
    fmt.line(f"{what}: per-head statistics (no pattern materialised)")
    fmt.table("Every head: mean entropy (nats) and mean max weight over the queries, share of weight on the "
              "first token", ["layer.head", "mean entropy", "mean max weight", "first-token share", "kind"],
              [(f"{a}.{b}", f"{float(grid['mean entropy'][a, b]):.3f}", f"{float(grid['mean max weight'][a, b]):.3f}",
                f"{float(grid['first-token share'][a, b]):.3f}", label.get((a, b), ""))
               for a, b in pairs])
    fmt.line(f"Sink heads: {_names(kinds['sink'])}. Sharp heads: {_names(kinds['sharp'])}.")
    emptied = [str(a) for a in range(stats.n_layers) if not stats.held(a)]
    if emptied:
        fmt.line(f"Head surgery removed every head of layer{'s' if len(emptied) > 1 else ''} {', '.join(emptied)} "
                 "(the placeholder head it keeps is not shown).")
    if stats.heads is not None:
        fmt.line("Heads are numbered as in the model before head surgery (--json: \"original_heads\").")
    return 0


def _names(pairs: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}.{b}" for a, b in pairs) or "none"
