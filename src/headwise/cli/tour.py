"""``headwise tour``: one attention layer, step by step, with the head-by-head check."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from . import CliError
from . import format as fmt
from ._progress import steps
from ._sizes import add_layer_options, human_bytes, layer_from_args, layer_tensors, numel, size

if TYPE_CHECKING:
    from ..config import AttentionConfig

# The tour runs real float32 tensors; beyond this much memory it points to `explain` (meta tensors).
MAX_TOUR_BYTES = 2 * 2 ** 30


def tour_bytes(config: "AttentionConfig", seq: int, batch: int) -> tuple[int, int]:
    """(about how many bytes the tour holds at its peak, of which the (b, h, s, s) scores), in float32.

    The walk keeps every step's tensor; the scores exist three times (product, scaled, softmax) and the
    per-head run and the flatten check add a few more activations.
    """
    shapes = layer_tensors(config, seq, batch)
    weights = sum(numel(shapes[w]) for w in ("W_Q", "W_K", "W_V", "W_O"))
    widest = max(numel(shapes[a]) for a in ("x", "Q", "K", "y"))
    scores = 3 * numel(shapes["scores"])
    return 4 * (weights + 16 * widest + scores), 4 * scores


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tour", help="walk one attention layer step by step (shapes, views, copies)")
    add_layer_options(p, default_d_model=4096, default_n_heads=32)
    p.add_argument("--seq", type=size, default=128, help="tokens (default 128)")
    p.add_argument("--batch", type=size, default=1)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run)


def tour(config: "AttentionConfig", seq: int, batch: int, *, progress: bool = False) -> dict:
    """Everything the tour shows, as data (``progress``: a progress line on stderr when it is a terminal)."""
    start = time.perf_counter()
    with steps(4, enabled=progress) as step:
        step("importing torch")
        import torch

        from ..attention import MultiHeadAttention
        from ..walkthrough import flatten_bug_error, head_by_head_error, walk

        step("building the layer and walking it step by step")
        torch.manual_seed(0)
        attn = MultiHeadAttention.from_config(config.replace(bias=False))
        walked = walk(attn.config, seq_len=seq, batch=batch, attn=attn)
        step("running every head alone")
        x = torch.randn(batch, seq, config.d_model)
        err = head_by_head_error(attn, x)
        step("the flatten-without-transpose bug")
        with torch.no_grad():
            y = attn(x)
            bug = flatten_bug_error(attn.project_q(x))  # any (b, h, s, d_h) tensor shows the flatten bug
        n_params = sum(p.numel() for p in attn.parameters())
    return {
        "config": config.to_dict() | {"d_head": config.d_head, "n_kv_heads": config.n_kv_heads},
        "steps": [s.to_dict() for s in walked],
        "parameters_without_bias": n_params,
        "four_d_model_squared": 4 * config.d_model ** 2,
        "head_by_head_max_abs_diff": err,
        "head_by_head_equal": err <= 1e-4 * max(1.0, float(y.abs().max())),
        "flatten_without_transpose_max_abs_diff": bug,
        "seconds": time.perf_counter() - start,
    }


def run(args: argparse.Namespace) -> int:
    config, _, _ = layer_from_args(args)
    total, scores = tour_bytes(config, args.seq, args.batch)
    if total > MAX_TOUR_BYTES:
        raise CliError(f"the tour runs real float32 tensors and this one would hold about {human_bytes(total)} "
                       f"({human_bytes(scores)} of them the (b, h, s, s) scores), over its limit of "
                       f"{human_bytes(MAX_TOUR_BYTES)}; `headwise explain` walks any size on meta tensors")
    result = tour(config, args.seq, args.batch, progress=not args.json)
    if not result["head_by_head_equal"]:
        import sys

        print("headwise tour: FAILED: the heads run one by one do not add up to the packed layer", file=sys.stderr)
    if args.json:
        fmt.emit_json(result)
        return 0 if result["head_by_head_equal"] else 1
    c = config
    # --d-head (or a preset's head_dim) may differ from d_model / n_heads: the arithmetic is shown only when it holds
    d_head = (f"d_head = {c.d_model} / {c.n_heads} = {c.d_head}" if c.d_head * c.n_heads == c.d_model
              else f"d_head = {c.d_head} (given, not d_model / n_heads)")
    fmt.line(f"One attention layer: d_model={c.d_model}, n_heads={c.n_heads}, n_kv_heads={c.n_kv_heads} ({c.kind}), "
             f"{d_head}, {args.seq} tokens, batch {args.batch}")
    fmt.table("Shape walk (eager path; the fused default never materialises scores/softmax)",
              ["step", "code", "shape", "stride", "view or new", "note"],
              [(s["name"], s["code"], s["shape"], s["stride"], s["kind"], s["note"]) for s in result["steps"]],
              optional=["note", "code"])
    p = result["parameters_without_bias"]
    fmt.line(f"Parameters (W_Q, W_K, W_V, W_O, no bias): {p:,}" + _parameters_note(c, p))
    fmt.line(f"Head by head: every head run alone, concatenated, then W_O, vs the packed layer: "
             f"max |diff| = {result['head_by_head_max_abs_diff']:.2e} -> "
             f"{'equal (rounding only)' if result['head_by_head_equal'] else 'DIFFERENT'}")
    fmt.line(f"The classic bug, flattening (b, h, s, d_h) without transposing back: same shape, "
             f"max |diff| = {result['flatten_without_transpose_max_abs_diff']:.2f}")
    fmt.line(f"Done in {result['seconds']:.1f} s.")
    return 0 if result["head_by_head_equal"] else 1


def _parameters_note(c: "AttentionConfig", p: int) -> str:
    """Why the count is or is not 4 d^2: each reason that holds (a head width that does not split d_model,
    fewer K/V heads, key or value inputs of another width), never one assumed for all."""
    if p == 4 * c.d_model ** 2:
        return f" = 4 x {c.d_model}^2"
    why = []
    if c.n_heads * c.d_head != c.d_model:
        why.append(f"n_heads x d_head = {c.n_heads} x {c.d_head} = {c.n_heads * c.d_head}, not d_model")
    if c.n_kv_heads != c.n_heads:
        why.append(f"{c.kind} shrinks W_K, W_V to {c.n_kv_heads} of {c.n_heads} heads")
    for name in ("kdim", "vdim"):
        if getattr(c, name) != c.d_model:
            why.append(f"{name} = {getattr(c, name)}, not d_model")
    return f" (not 4 x {c.d_model}^2: {'; '.join(why)})" if why else f" (not 4 x {c.d_model}^2)"
