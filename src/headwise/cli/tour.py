"""``headwise tour``: the seeds' layer, step by step, with the head-by-head check."""

from __future__ import annotations

import argparse
import time

import torch

from ..attention import MultiHeadAttention
from ..config import AttentionConfig
from ..walkthrough import flatten_bug_error, head_by_head_error, walk
from . import CliError
from . import _format as fmt
from ._sizes import add_layer_options, human_bytes, layer_from_args, positive

# The tour runs real float32 tensors; beyond this much weight memory it points to `explain` (meta tensors).
MAX_WEIGHT_BYTES = 2 * 2 ** 30


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tour", help="walk one attention layer step by step (shapes, views, copies)")
    add_layer_options(p, default_d_model=4096, default_n_heads=32)
    p.add_argument("--seq", type=int, default=128, help="tokens (default 128)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run)


def tour(config: AttentionConfig, seq: int, batch: int) -> dict:
    """Everything the tour shows, as data."""
    start = time.perf_counter()
    torch.manual_seed(0)
    attn = MultiHeadAttention.from_config(config.replace(bias=False))
    steps = walk(attn.config, seq_len=seq, batch=batch, attn=attn)
    x = torch.randn(batch, seq, config.d_model)
    err = head_by_head_error(attn, x)
    with torch.no_grad():
        y = attn(x)
        bug = flatten_bug_error(attn.project_q(x))  # any (b, h, s, d_h) tensor shows the flatten bug
    n_params = sum(p.numel() for p in attn.parameters())
    return {
        "config": config.to_dict() | {"d_head": config.d_head, "n_kv_heads": config.n_kv_heads},
        "steps": [s.to_dict() for s in steps],
        "parameters_without_bias": n_params,
        "four_d_model_squared": 4 * config.d_model ** 2,
        "head_by_head_max_abs_diff": err,
        "head_by_head_equal": err <= 1e-4 * max(1.0, float(y.abs().max())),
        "flatten_without_transpose_max_abs_diff": bug,
        "seconds": time.perf_counter() - start,
    }


def run(args: argparse.Namespace) -> int:
    config, _, _ = layer_from_args(args)
    positive("seq", args.seq), positive("batch", args.batch)
    weight_bytes = 4 * (2 * config.d_model * config.inner_dim + config.kdim * config.kv_dim
                        + config.vdim * config.kv_dim)
    if weight_bytes > MAX_WEIGHT_BYTES:
        raise CliError(f"this layer's weights alone take {human_bytes(weight_bytes)} in float32 (the tour runs real "
                       f"tensors, limit {human_bytes(MAX_WEIGHT_BYTES)}); `headwise explain` walks it on meta tensors")
    result = tour(config, args.seq, args.batch)
    if args.json:
        fmt.emit_json(result)
        return 0 if result["head_by_head_equal"] else 1
    c = config
    fmt.line(f"One attention layer: d_model={c.d_model}, n_heads={c.n_heads}, n_kv_heads={c.n_kv_heads} ({c.kind}), "
             f"d_head = {c.d_model} / {c.n_heads} = {c.d_head}, {args.seq} tokens, batch {args.batch}")
    fmt.table("Shape walk (eager path; the fused default never materialises scores/softmax)",
              ["step", "code", "shape", "stride", "view or new", "note"],
              [(s["name"], s["code"], s["shape"], s["stride"], s["kind"], s["note"]) for s in result["steps"]])
    p = result["parameters_without_bias"]
    fmt.line(f"Parameters (W_Q, W_K, W_V, W_O, no bias): {p:,}"
             + (f" = 4 x {c.d_model}^2" if p == result["four_d_model_squared"] else " (GQA shrinks W_K, W_V)"))
    fmt.line(f"Head by head: every head run alone, concatenated, then W_O, vs the packed layer: "
             f"max |diff| = {result['head_by_head_max_abs_diff']:.2e} -> "
             f"{'equal (rounding only)' if result['head_by_head_equal'] else 'DIFFERENT'}")
    fmt.line(f"The classic bug, flattening (b, h, s, d_h) without transposing back: same shape, "
             f"max |diff| = {result['flatten_without_transpose_max_abs_diff']:.2f}")
    fmt.line(f"Done in {result['seconds']:.1f} s.")
    return 0 if result["head_by_head_equal"] else 1
