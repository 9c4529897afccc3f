"""``headwise explain``: one layer's shape walk, then what it costs (parameters, FLOPs, KV cache, memory)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..analysis import dtype_info, summarize
from ..analysis.parallel import parallel_costs
from ..analysis.memory import DTYPE_NAMES
from ..presets import get_preset
from . import CliError
from . import format as fmt
from ._progress import steps
from .compare import length_note
from ._sizes import add_layer_options, human_bytes, human_count, layer_from_args, refuse_unrepresentable, size

# Above this many bytes of weights + activations + scores the walk runs on meta tensors (shapes only).
REAL_TENSOR_LIMIT = 256 * 2 ** 20
# The dtype of a walk on real CPU tensors, whatever --dtype says (strides do not depend on the dtype): its
# tensors, not --dtype's, are what the limit is about.
CPU_WALK_DTYPE = "float32"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="shape walk-through and costs of one layer (parameters, FLOPs, memory)")
    add_layer_options(p)
    p.add_argument("--seq", type=size, default=4096, help="tokens (default 4096)")
    p.add_argument("--batch", type=size, default=1)
    p.add_argument("--dtype", default="float16", help=f"storage dtype (default float16; one of {sorted(DTYPE_NAMES)})")
    p.add_argument("--n-layers", type=size, default=None, help="layers (default: the preset's, else 1)")
    p.add_argument("--ranks", type=size, default=None,
                   help="also show per-rank memory and communication over this many ranks, tensor vs sequence "
                        "parallel")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run)


def explain(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``explain`` shows, as data."""
    config, preset_layers, preset = layer_from_args(args)
    seq, batch = args.seq, args.batch
    n_layers = args.n_layers if args.n_layers is not None else (preset_layers or 1)
    try:
        dtype, itemsize = dtype_info(args.dtype)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    refuse_unrepresentable(config, seq, batch, itemsize)  # before torch: the walk could not describe it
    cited = None if preset is None else get_preset(preset)
    window = None if cited is None else cited.sliding_window
    parallel = None
    if args.ranks is not None:  # pure arithmetic: refused before anything heavy
        parallel = parallel_costs(config, seq, args.ranks, batch=batch, dtype=dtype, sliding_window=window)
        if "error" in parallel["tp"] and "error" in parallel["sp"]:
            from ..parallel.plan import valid_world_sizes

            raise CliError(f"neither split works over --ranks {args.ranks}: tensor parallel needs one of "
                           f"{valid_world_sizes(config.n_heads, config.n_kv_heads)} ranks, sequence parallel at most "
                           f"n_heads={config.n_heads}")
    summary = summarize(config, seq, batch=batch, dtype=dtype, n_layers=n_layers, sliding_window=window)
    live = (summary["params"]["layer"]["total"] + 6 * batch * seq * max(config.d_model, config.inner_dim)
            + 2 * batch * config.n_heads * seq * seq) * dtype_info(CPU_WALK_DTYPE)[1]
    device = "meta" if live > REAL_TENSOR_LIMIT else "cpu"
    with steps(2, enabled=not args.json) as step:
        step("importing torch")
        from ..analysis import parse_dtype
        from ..walkthrough import walk

        step(f"walking the layer on {device} tensors")
        walk_dtype = parse_dtype(dtype if device == "meta" else CPU_WALK_DTYPE)
        walked = walk(config, seq_len=seq, batch=batch, device=device, dtype=walk_dtype)
    extra = {} if parallel is None else {"parallel": parallel}
    note = None if cited is None else length_note(seq, cited.to_dict())
    if note:
        extra["note"] = note
    return summary | {"preset": preset, "walk_device": device, "steps": [s.to_dict() for s in walked]} | extra


def run(args: argparse.Namespace) -> int:
    r = explain(args)
    if "note" in r:
        print(f"headwise explain: note: {r['note']}", file=sys.stderr)
    if args.json:
        fmt.emit_json(r)
        return 0
    c = r["config"]
    name = f"{r['preset']}: " if r["preset"] else ""
    fmt.line(f"{name}d_model={c['d_model']}, n_heads={c['n_heads']}, n_kv_heads={c['n_kv_heads']} ({c['kind']}), "
             f"d_head={c['d_head']}, bias={c['bias']}; {r['seq_len']} tokens, batch {r['batch']}, {r['dtype']}, "
             f"{fmt.plural(r['n_layers'], 'layer')}")
    where = ("meta tensors (shapes and strides only, no memory)" if r["walk_device"] == "meta"
             else "real CPU tensors")
    fmt.table(f"Shape walk of one layer, on {where}", ["step", "code", "shape", "stride", "view or new", "note"],
              [(s["name"], s["code"], s["shape"], s["stride"], s["kind"], s["note"]) for s in r["steps"]],
              optional=["note", "code"])
    fmt.table("Costs", ["quantity", "one layer", fmt.plural(r['n_layers'], 'layer'), "how"], cost_rows(r),
              optional=["how"])
    if "parallel" in r:
        par = r["parallel"]
        fmt.table(f"Per rank over {par['ranks']} ranks, one layer (training; {r['dtype']})",
                  ["per rank", "tensor parallel", "sequence parallel"], parallel_rows(par))
        for key in ("tp", "sp"):
            fmt.line(f"{key}: {par[key].get('error') or par[key]['plan']}")
    return 0


def parallel_rows(par: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The TP-vs-SP table: one row per figure; 'impossible' where a split fails, '-' where it has no such thing."""
    rows = [("weights", "weights"), ("layer input + output", "input_output"),
            ("Q, K, V, context (attention)", "qkv_context"), ("probabilities, eager", "probabilities_eager"),
            ("log-sum-exp, fused", "lse_fused"), ("KV cache, all tokens", "kv_cache"),
            ("sent, forward", "sent_forward"), ("sent, backward", "sent_backward"),
            ("weight-grad all-reduce/step", "weight_grad_all_reduce")]

    def cell(d: dict[str, Any], fig: str) -> str:
        if "error" in d:
            return "impossible"
        if fig == "heads":
            return f"{d['heads']} / {d['kv_heads']}"
        return "-" if d[fig] is None else human_bytes(d[fig])

    held = par.get("kv_positions", par["seq_len"])
    kv_label = "KV cache, all tokens" if held == par["seq_len"] else f"KV cache, last {held} tokens"  # a window
    return [(kv_label if fig == "kv_cache" else label, cell(par["tp"], fig), cell(par["sp"], fig))
            for label, fig in [("query / K/V heads attended", "heads"), *rows]]


def cost_rows(r: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    c, n = r["config"], r["n_layers"]
    p, f, kv, m = r["params"], r["flops"], r["kv_cache"], r["probabilities"]
    pl, fl = p["layer"], f["layer"]
    inner, kv_dim = c["n_heads"] * c["d_head"], c["n_kv_heads"] * c["d_head"]
    window = f", window {kv['sliding_window']}" if kv["positions"] < r["seq_len"] else ""
    return [
        ("parameters", f"{pl['total']:,}", f"{p['all_layers']:,}",
         f"without bias {p['layer_without_bias']:,}"),
        ("  W_Q / W_K / W_V / W_O", f"{pl['q']:,} / {pl['k']:,} / {pl['v']:,} / {pl['out']:,}", "",
         f"W_K, W_V: {c['d_model']} x {kv_dim}" + (" (GQA/MQA shrink them)" if c["kind"] != "MHA" else "")),
        ("FLOPs, projections", human_count(fl["projections"], "FLOP"), human_count(fl["projections"] * n, "FLOP"),
         "2 x multiply-adds of x W_Q, x W_K, x W_V, concat W_O"),
        ("FLOPs, attention", human_count(fl["attention"], "FLOP"), human_count(fl["attention"] * n, "FLOP"),
         f"Q K^T + P V: 4 b h s^2 d_h; causal, skipping masked: {human_count(f['layer_attention_causal_skip'], 'FLOP')}"),
        ("FLOPs, total", human_count(fl["total"], "FLOP"), human_count(f["all_layers"], "FLOP"), ""),
        ("KV cache per token", human_bytes(kv["per_token_layer_bytes"]), human_bytes(kv["per_token_bytes"]),
         f"2 x h_kv x d_h x {r['dtype']} = 2 x {c['n_kv_heads']} x {c['d_head']}"),
        ("KV cache per 1k tokens", human_bytes(kv["per_token_layer_bytes"] * 1000), human_bytes(kv["per_1k_tokens_bytes"]),
         "per sequence"),
        (f"KV cache, {r['seq_len']} tokens x batch {r['batch']}{window}", human_bytes(kv["context_bytes"] / n),
         human_bytes(kv["context_bytes"]),
         f"a sliding window: each layer caches only the last {kv['positions']} positions" if window else ""),
        ("probabilities, eager (materialised)", human_bytes(m["materialised"]), human_bytes(m["materialised_all_layers"]),
         f"b x h x s^2 x {m['materialised'] // (r['batch'] * c['n_heads'] * r['seq_len'] ** 2)} B (float32 for half "
         f"precision); all layers = kept for backward"),
        ("probabilities, fused (SDPA/flash)", human_bytes(m["fused"]), human_bytes(m["fused_all_layers"]),
         f"one log-sum-exp per (b, h, query); {_than_eager(m['fused'], m['materialised'])}"),
    ]


def _than_eager(fused: int, eager: int) -> str:
    """How the fused path's bytes compare with the eager path's: "4,096x less", "2x more" or "the same" (at one
    token, or in fp8 at short lengths, the log-sum-exp (float32 or wider) is as large as the probabilities or larger)."""
    if fused == eager:
        return "the same"
    ratio = max(fused, eager) / min(fused, eager)
    times = f"{ratio:,.0f}" if ratio >= 100 else f"{ratio:.3g}"
    return f"{times}x {'less' if fused < eager else 'more'}"
