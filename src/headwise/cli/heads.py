"""``headwise heads``: every head of a real model on your text (the bundled all-MiniLM-L6-v2, or a local
``save_pretrained`` directory of any text model whose attention :func:`headwise.interop.patch` takes over: BERT,
GPT-2, the Llama family, and every family on transformers' attention interface, pruned checkpoints saved by
:func:`headwise.surgery.save_pretrained` included): where each head reads from and what it writes, as a table, a
PNG or an interactive HTML page, captured from the model's own forward (``headwise.trace``). Where a family's W_O
is not located, only the reads are drawn, and a note says why.

Every argument is checked against the model's ``config.json`` before torch or the model loads; text longer
than ``--max-tokens`` is cut and the cut is announced on stderr; a ``--max-tokens`` beyond the model's
position limit is refused. ``--stats`` draws every layer x head from per-head statistics instead of patterns, at
any length the model takes (:mod:`headwise.cli.heads_stats`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from . import CliError
from . import format as fmt
from ._output import save
from ._progress import steps
from ._sizes import size
from .heads_checks import check_args, check_size, drawn_layers, emptied, info_of, uneven
from .heads_stats import parse_pairs, run_stats

BUNDLED = "all-minilm-l6-v2"
# Tokens listed in full on the first line; longer texts show the first and last few.
_LIST_TOKENS = 40


def parse_heads(text: str) -> list[int]:
    """``"0,3,5-7"`` -> ``[0, 3, 5, 6, 7]`` (sorted, without repeats); ValueError otherwise."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be head numbers and ranges such as 0,3,5-7, got {text!r}")
        if a < 0 or b < a:
            raise argparse.ArgumentTypeError(f"{part!r} is not a head number or a range lo-hi (lo <= hi)")
        if b - a > 100_000:
            raise argparse.ArgumentTypeError(f"range {part!r} is larger than any model's head count")
        out.update(range(a, b + 1))
    return sorted(out)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("heads", help="what every head of a real model reads and writes, on your text")
    p.add_argument("text", help="the text to run through the model (one starting with '-' and without a space "
                                "goes after '--': headwise heads -- -x)")
    p.add_argument("--model", default=BUNDLED, metavar="DIR",
                   help=f"a local save_pretrained directory of a text model with its tokenizer (never downloaded): "
                        f"any family whose attention headwise.interop.patch takes over (BERT, GPT-2, Llama, and "
                        f"every family on transformers' attention interface), or {BUNDLED} (bundled; the default)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--layer", type=int, default=None, metavar="L", help="attention layer, from 0 (default 0)")
    which.add_argument("--all-layers", action="store_true", help="every layer: the model view")
    p.add_argument("--heads", type=parse_heads, default=None, metavar="LIST",
                   help="only these heads, e.g. 0,3,5-7 (default: all)")
    p.add_argument("--out", default=None, metavar="FILE", help="draw the heads into FILE.png (needs headwise[viz]) or FILE.html instead of printing "
                        "the table (one line says where; --json still prints the data)")
    p.add_argument("--max-tokens", type=size, default=None, metavar="N",
                   help="cut the text to this many tokens, at most the model's position limit (default 64, or "
                        "the position limit where smaller; with --stats the position limit); a cut is announced on stderr")
    p.add_argument("--stats", action="store_true",
                   help="every layer x head at long context from per-head statistics (no pattern): mean entropy, "
                        "mean max weight, first-token share, the sink and sharp heads, per-position curves")
    p.add_argument("--curves", type=parse_pairs, default=None, metavar="L.H,...",
                   help="with --stats: the (layer.head) pairs whose per-position curves are drawn (default: the "
                        "strongest sink, the sharpest and the most spread head)")
    p.add_argument("--json", action="store_true", help="print the per-head arrays and summary as JSON")
    p.set_defaults(run=run)


def _loading(info: Any, what: str) -> Any:
    """The tokenizer or the model of a local checkpoint (``what``), an unreadable directory in one line."""
    from ..viz import models

    try:
        return models.load_tokenizer(info) if what == "tokenizer" else models.load(info)
    except OSError as exc:  # a half-saved directory: say which, in one line
        raise CliError(f"--model: cannot load {str(info.path)!r}: {exc}") from None
    except json.JSONDecodeError as exc:  # the decoder's message names no file: find the one that is not JSON
        bad = _unparsable_json(Path(info.path))
        where = repr(str(Path(info.path) / bad)) if bad else f"a JSON file of {str(info.path)!r}"
        raise CliError(f"--model: cannot load the {what}: {where} is not valid JSON ({exc})") from None
    except UnicodeEncodeError as exc:  # a directory named in bytes that are not UTF-8: the loader cannot open it
        path = str(info.path)
        if any("\ud800" <= c <= "\udfff" for c in path):  # bytes Python decoded with surrogateescape
            raise CliError(f"--model: cannot load the {what} of {path!r}: its path is not valid UTF-8 (the bytes "
                           f"{os.fsencode(path)!r}); rename the directory") from None
        raise CliError(f"--model: cannot load the {what} of {path!r}: {exc}") from None
    except ValueError as exc:  # weights that are not the config's model (refuse_incomplete), a bad sidecar
        raise CliError(str(exc)) from None
    except Exception as exc:
        # huggingface_hub's StrictDataclassError (a config value of the wrong type, e.g. max_position_embeddings:
        # null) is no ValueError; matched by name so that its module need not be imported
        if not any(c.__name__ == "StrictDataclassError" for c in type(exc).__mro__):
            raise
        raise CliError(f"--model: cannot load the {what} of {str(info.path)!r}: config.json: {exc}") from None


def _unparsable_json(path: Path) -> str | None:
    """The name of the checkpoint's first ``*.json`` file that does not parse, or None."""
    for file in sorted(path.glob("*.json")):
        try:
            json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
            return file.name
    return None


def _patched(model: Any, info: Any) -> list:
    """The model's headwise layers (patching it), one per layer of config.json, or one line saying why not."""
    from ..viz.maps import model_layers

    try:
        found = model_layers(model)
    except (TypeError, ValueError) as exc:  # what patch says: not on the attention interface, flash attention...
        raise CliError(_refusal(model, info, exc)) from None
    if len(found) != info.n_layers:
        raise CliError(f"--model: model_type {info.family!r}: config.json says {fmt.plural(info.n_layers, 'layer')}, "
                       f"but headwise.interop.patch found {fmt.plural(len(found), 'attention module')} (shared layers, "
                       "or layers without attention); headwise heads draws models with one attention module per layer")
    return found


def _refusal(model: Any, info: Any, exc: Exception) -> str:
    """Why ``patch`` refused ``model``, the reason first (patch's own message, which lists what it supports, last:
    the one-line error is cut at 400 characters)."""
    from ..interop.hf.layer import is_target

    head = f"--model: model_type {info.family!r} cannot be drawn"
    if isinstance(exc, TypeError) and not any(is_target(m) for m in model.modules()):
        found = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")})
        return (f"{head}: its attention ({', '.join(found) or 'no module named *Attention'}) does not go through "
                f"transformers' attention interface and has no headwise adapter, so headwise.interop.patch refuses "
                f"it ({exc})")
    return f"{head}: {exc}"


def _check_tokens(tokenizer: Any, args: argparse.Namespace) -> None:
    """The cut must leave one token of the text beside the special tokens the tokenizer adds ([CLS] ... [SEP]):
    the library's rule (the position limit was checked before loading)."""
    from ..viz.maps import check_max_tokens

    try:
        check_max_tokens(args.max_tokens, tokenizer, name="--max-tokens")
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _model_inputs(enc: dict, model: Any) -> dict:
    """The tokenizer's inputs that the model's forward takes (token_type_ids only where it has them)."""
    import inspect

    try:
        takes = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - every transformers forward has a signature
        takes = {}
    keep = ("input_ids", "attention_mask", "token_type_ids")
    return {k: v for k, v in enc.items() if k in keep and (k == "input_ids" or k in takes)}


def heads(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``heads`` shows, as data (one HeadMaps per drawn layer under ``"maps"``)."""
    info, out = check_args(args)
    notes: list[str] = []
    with steps(4 if out else 3, enabled=not args.json) as step:
        step("importing torch and transformers")
        from ..surgery.hosts import quiet
        from ..viz import maps as vmaps

        with quiet():  # our progress line replaces transformers' bars and notes, for this call only
            maps, tokens, n_tokens = _draw(args, info, out, step, notes, vmaps)
    for note in notes:
        print(f"headwise heads: note: {note}", file=sys.stderr)
    return {"model": info.name, "family": info.family, "maps": maps, "out": None if out is None else str(out),
            "text_tokens": n_tokens, "truncated": n_tokens > len(tokens), "notes": notes}


def _load(args: argparse.Namespace, info: Any, step: Any, notes: list[str], check: Any = None) -> tuple:
    """(inputs, tokens, tokens before the cut, patched model): the text cut to ``--max-tokens`` (the cut in
    ``notes``); ``check(tokens)`` runs before the model's weights load."""
    step(f"loading {info.name} ({'bundled, ' if info.bundled else ''}offline)")
    if info.bundled:
        from ..viz.maps import load_minilm

        tokenizer, model = load_minilm()
    else:
        from ..viz.models import check_known

        try:
            check_known(info)
        except ValueError as exc:
            raise CliError(str(exc)) from None
        tokenizer, model = _loading(info, "tokenizer"), None
        _check_tokens(tokenizer, args)
    if not tokenizer(args.text, add_special_tokens=False, verbose=False)["input_ids"]:
        # zero-width or control characters pass the blank check above but leave only [CLS] [SEP]: nothing to draw
        raise CliError(f"text must not be empty: {args.text!r} has no tokens for this tokenizer (only the "
                       f"special tokens it adds)")
    n_tokens = len(tokenizer(args.text, verbose=False)["input_ids"])  # before the cut, to announce it
    enc = dict(tokenizer(args.text, return_tensors="pt", truncation=True, max_length=args.max_tokens))
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"][0].tolist())
    if n_tokens > len(tokens):
        limit = f"; the model takes at most {info.max_positions}" if info.max_positions else ""
        notes.append(f"the text has {n_tokens} tokens; only the first {len(tokens)} are drawn "
                     f"(--max-tokens {args.max_tokens}{limit})")
    if check is not None:
        check(tokens)
    if model is None:
        model = _loading(info, "model")
    _patched(model, info)
    return _model_inputs(enc, model), tokens, n_tokens, model


def _draw(args: argparse.Namespace, info: Any, out: Path | None, step: Any, notes: list[str], vmaps: Any) -> tuple:
    """(maps, tokens, tokens before the cut): load, run and (with ``out``) draw."""
    layers = drawn_layers(args, info)
    most = info.heads_of(None if args.all_layers else args.layer)[1]
    inputs, tokens, n_tokens, model = _load(args, info, step, notes, lambda tokens: check_size(
        len(layers), most, len(args.heads or range(most)), len(tokens), out is not None and out.suffix.lower() != ".png"))
    step(f"running {'every layer' if args.all_layers else f'layer {args.layer}'} head by head")
    maps = vmaps.model_layers_head_maps(model, inputs, layers=layers, tokens=tokens)
    if args.heads is not None:  # by the numbers shown: the original ones after head surgery
        gone = next(((m.layer, h, m.head_labels) for m in maps for h in args.heads if h not in m.head_labels), None)
        if gone:  # the model's own record, where the sidecar read before loading did not say
            raise CliError(f"--heads: layer {gone[0]} has no head {gone[1]}: its heads are "
                           f"{', '.join(map(str, gone[2])) or 'none (head surgery removed every one)'}")
        maps = [m.subset([m.head_labels.index(h) for h in args.heads]) for m in maps]
    missing = next((m.writes_missing for m in maps if m.writes is None), "")
    if missing:
        notes.append(f"what each head writes is not drawn (only where it reads): {missing}")
    if out is not None and len({m.n_heads for m in maps}) > 1:  # counts the sidecar did not give
        raise CliError(uneven([m.n_heads for m in maps]))
    if out is not None:
        step(f"drawing {out}")
        png = out.suffix.lower() == ".png"
        title = f"headwise: {info.name}, {_what(args, info, png)}, {fmt.plural(len(tokens), 'token')}"
        if png:
            from ..viz.png import png_plan, save_png

            notes += png_plan(maps).notes
            save(out, lambda tmp: save_png(maps, tmp, title=title))
        else:
            from ..viz.html import save_html

            save(out, lambda tmp: save_html(maps, tmp, title=title))
    return maps, tokens, n_tokens


def _what(args: argparse.Namespace, info: Any, png: bool = False) -> str:
    """The layers (and chosen heads) drawn; a PNG's model view draws only the first MAX_ROWS layers."""
    layers = f"all {fmt.plural(info.n_layers, 'layer')}" if args.all_layers else f"layer {args.layer}"
    if png and args.all_layers:
        from ..viz.png import MAX_ROWS

        if info.n_layers > MAX_ROWS:
            layers = f"first {MAX_ROWS} of {info.n_layers} layers"
    return layers + (f", heads {','.join(map(str, args.heads))}" if args.heads is not None else "")


def _head_count(counts: list[int], png_model_view: bool = False) -> str:
    """The heads drawn per layer: "12 heads", or after head surgery left layers uneven, "2-4 heads per layer";
    a PNG's model view draws only the first MAX_COLS (a picture's layers hold the same heads)."""
    if min(counts) == max(counts):
        if png_model_view:
            from ..viz.png import MAX_COLS

            if counts[0] > MAX_COLS:
                return f"first {MAX_COLS} of {counts[0]} heads"
        return fmt.plural(counts[0], "head")
    return f"{min(counts)}-{max(counts)} heads per layer"


def _token_list(tokens: list[str]) -> str:
    if len(tokens) <= _LIST_TOKENS:
        return " ".join(tokens)
    return " ".join(tokens[:30]) + f" ... ({len(tokens) - 35} more) ... " + " ".join(tokens[-5:])


def _stats_inputs(args: argparse.Namespace, info: Any, step: Any) -> tuple[dict, list[str], Any, int]:
    """(model inputs, tokens, patched model, tokens before the cut) for ``--stats``; a cut of the text is
    announced on stderr."""
    notes: list[str] = []
    inputs, tokens, n_tokens, model = _load(args, info, step, notes)
    for note in notes:
        print(f"headwise heads: note: {note}", file=sys.stderr)
    return inputs, tokens, model, n_tokens


def run(args: argparse.Namespace) -> int:
    if args.stats:
        info, out = check_args(args)
        if args.curves is not None and out is None:  # the table and --json hold every head: it would change nothing
            raise CliError("--curves chooses the heads whose per-position curves are drawn: give --out FILE.png or "
                           "FILE.html")
        return run_stats(args, info, out, lambda step: _stats_inputs(args, info, step))
    r = heads(args)
    maps = r["maps"]
    head = {"model": r["model"], "family": r["family"], "out": r["out"], "text_tokens": r["text_tokens"],
            "truncated": r["truncated"]}
    if args.json:
        layers = [m.to_dict() | {"summary": m.summary()} for m in maps]
        fmt.emit_json(head | {"layers": layers} if args.all_layers else layers[0] | head)
        return 0
    first = maps[0]
    png = r["out"] is not None and r["out"].lower().endswith(".png")
    what = (f"{r['model']}, {_what(args, info_of(args.model), png)}, "
            f"{_head_count([m.n_heads for m in maps], png and len(maps) > 1)}, {fmt.plural(len(first.tokens), 'token')}")
    if r["out"]:  # the picture is the answer: say where it is, not the table again
        fmt.line(f"Wrote {r['out']} ({what})")
        return 0
    fmt.line(f"{what}: " + _token_list(first.tokens))
    many = len(maps) > 1
    fmt.table("What each head does by position, where it reads from, and what it actually writes (weight x "
              "||value W_O||)",
              ["layer.head" if many else "head", "by position (mean weight)", "reads most from (mean weight)",
               "writes most from (share of writes)", "share of writes from the most-read token",
               "||v W_O|| min..max"],
              [(f"{m.layer}.{s['head']}" if many else s["head"], _position(s),
                f"{s['reads_most']} ({s['reads_most_weight']:.2f})", *_writes(s)) for m in maps for s in m.summary()],
              optional=["||v W_O|| min..max", "share of writes from the most-read token"])
    if any(not m.n_heads for m in maps):
        fmt.line(emptied([m.layer for m in maps if not m.n_heads]).capitalize() + ".")
    if any(m.original_heads is not None for m in maps):
        fmt.line("Heads are numbered as in the model before head surgery (--json: \"heads\" are their indices now, "
                 "\"original_heads\" these numbers).")
    if any(m.writes is None for m in maps):
        fmt.line("What each head writes is not shown: W_O is not located for this family (the note on stderr "
                 "says why).")
    else:
        fmt.line("A large weight on a token whose value is near zero writes little: compare where a head reads most "
                 "from with where it writes most from.")
    return 0


_POSITION_NAMES = {"previous": "previous token", "same": "same token", "next": "next token", "first": "first token",
                   "separators": "separators"}


def _position(s: dict[str, Any]) -> str:
    """The head's strongest positional behaviour: "previous token (0.91)" (see headwise.viz.positions)."""
    if s["positional"] is None:
        return "n/a"
    return f"{_POSITION_NAMES[s['positional']]} ({s['positional_weight']:.2f})"


def _writes(s: dict[str, Any]) -> tuple[str, str, str]:
    """The table's write columns of one head's summary ("n/a" each where W_O is not located)."""
    if s["writes_most"] is None:
        return ("n/a",) * 3
    return (f"{s['writes_most']} ({s['writes_most_share']:.0%})", f"{s['weight_on_reads_most_share_of_writes']:.0%}",
            f"{s['value_norm_min']:.2f}..{s['value_norm_max']:.2f}")
