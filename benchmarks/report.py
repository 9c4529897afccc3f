"""Goals, tables and the results files (``RESULTS.md``, ``results.json``) of a benchmark run.

A ratio is always ``headwise time / other time`` from the same group (same run, same inputs): below 1 means
headwise is faster.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from .ratios import paired_ratio, ratio_spread

__all__ = ["machine_info", "allocator_env", "paired_ratio", "ratio_spread", "ratio_rows", "evaluate_goals", "write_results",
           "write_summary", "group_table_rows"]

GiB = 1 << 30


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(command: str, quick: bool) -> dict:
    """The machine and software a run used, and the command that produced it."""
    try:
        import transformers

        tf = transformers.__version__
    except Exception as exc:  # pragma: no cover - environment dependent
        tf = f"unavailable ({type(exc).__name__})"
    return {
        "cpu": _cpu_model(), "logical_cores": os.cpu_count(), "torch": torch.__version__, "transformers": tf,
        "python": platform.python_version(), "threads": torch.get_num_threads(),
        "mkldnn": torch.backends.mkldnn.is_available(), "cuda": torch.cuda.is_available(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command, "quick": quick, "dtype": "float32",
        "round_ratios": True,  # entries keep per-round times: ratios are taken round by round (ratios.py)
        "allocator": allocator_env(),
    }


def allocator_env() -> dict[str, str]:
    """glibc's allocator settings in this environment (``MALLOC_*_``, ``GLIBC_TUNABLES``): a large allocation
    mapped fresh on every call pays its page faults again, so they change what a run measures."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"}


def _ref_of(group: dict, entry: dict) -> dict | None:
    name = entry.get("vs")
    if name is None:
        name = next((e["name"] for e in group["entries"] if e["role"] == "headwise"), None)
    return next((e for e in group["entries"] if e["name"] == name), None)


def _spread_text(a: dict, b: dict) -> str:
    sp = ratio_spread(a, b)
    return "" if sp is None else f"{sp[0]:.3f}-{sp[1]:.3f}"


def ratio_rows(group: dict) -> list[dict]:
    """Every non-headwise entry's ratio: its headwise reference / it (:func:`benchmarks.ratios.paired_ratio`)."""
    out = []
    for e in group["entries"]:
        if e["role"] in ("headwise", "headwise2", "peak"):
            continue
        ref = _ref_of(group, e)
        if ref is None:
            continue
        out.append({"peer": e["name"], "headwise": ref["name"], "ratio": paired_ratio(ref, e),
                    "per_process": ratio_spread(ref, e)})
    return out


def group_table_rows(group: dict) -> list[list[str]]:
    """Rows of the printed/markdown table: name, median/min/max ms, ratio, GFLOP/s, output check."""
    rows = []
    for e in group["entries"]:
        ref = _ref_of(group, e)
        ratio = ""
        if ref is not None and ref is not e and e["role"] not in ("peak", "headwise2"):
            ratio = f"{paired_ratio(ref, e):.3f}"
            if spread := _spread_text(ref, e):
                ratio += f" ({spread})"
        flops = e.get("flops", group.get("flops"))
        gf = f"{flops / e['median_s'] / 1e9:.1f}" if flops else ""
        if group["case"] == "4 decode":
            gf = ""
        diff = e["max_abs_diff_vs_headwise"]
        check = "" if diff is None else (f"{'ok' if e['matches_headwise'] else 'DIFFERS'} ({diff:.1e})")
        extra = ""
        if "compiled_graphs_so_far" in e:
            extra = f" [graphs compiled: {e['compiled_graphs_so_far']}]"
        rows.append([e["name"] + extra, f"{e['median_s'] * 1e3:.2f}", f"{e['min_s'] * 1e3:.2f}",
                     f"{e['max_s'] * 1e3:.2f}", ratio, gf, check])
    return rows


TABLE_HEAD = ["entry", "median ms", "min ms", "max ms", "headwise / this", "GFLOP/s", "same output"]


# -- goals ----------------------------------------------------------------------------------------------------
def _entry(group: dict, name: str) -> dict | None:
    return next((e for e in group["entries"] if e["name"] == name), None)


def _ratio(group: dict, a: str, b: str) -> float | None:
    ea, eb = _entry(group, a), _entry(group, b)
    if ea is None or eb is None:
        return None
    return paired_ratio(ea, eb)


def _pair_row(label: str, a: dict, b: dict) -> tuple[str, float, float, str]:
    """A goal row for entries ``a`` / ``b``: label, paired ratio, ratio of the fastest rounds, per-process range."""
    return label, paired_ratio(a, b), a["min_s"] / b["min_s"], _spread_text(a, b)


def _row(group: dict, label: str, a: str, b: str) -> tuple[str, float, float, str] | None:
    """:func:`_pair_row` for the entries named ``a`` and ``b`` of ``group`` (None if either is absent)."""
    ea, eb = _entry(group, a), _entry(group, b)
    return None if ea is None or eb is None else _pair_row(label, ea, eb)


def _goal(goal: str, target: str, ratios: list[tuple], limit: float, why_missed: str = "") -> dict:
    """Status from the worst median ratio; ratios are (group, median ratio[, ratio of the fastest rounds[,
    per-process range]])."""
    if not ratios:
        return {"goal": goal, "target": target, "status": "not measured", "measured": "", "detail": ""}
    worst = max(ratios, key=lambda r: r[1])
    met = worst[1] <= limit

    def extra(r: tuple, fastest: str) -> str:
        parts = [f"{fastest} {r[2]:.3f}"] if len(r) > 2 and r[2] is not None else []
        if len(r) > 3 and r[3]:
            parts.insert(0, f"per process {r[3]}")
        return f" ({'; '.join(parts)})" if parts else ""

    detail = "; ".join(f"{r[0]}: {r[1]:.3f}{extra(r, 'min')}" for r in ratios)
    status = "met" if met else f"missed by {100 * (worst[1] / limit - 1):.1f} % (worst: {worst[0]})"
    measured = f"worst {worst[1]:.3f}{extra(worst, 'fastest rounds:')}"
    return {"goal": goal, "target": target, "status": status, "measured": measured,
            "detail": detail, "met": met, "why": "" if met else why_missed}


def evaluate_goals(groups: list[dict], memory: list[dict], notes: dict[str, str] | None = None) -> list[dict]:
    """Each goal of issue 5 with its status in this run (``notes`` adds the why of a miss, by goal key)."""
    notes = notes or {}
    by_case: dict[str, list[dict]] = {}
    for g in groups:
        by_case.setdefault(g["case"], []).append(g)
    goals = []

    def collect(case: str, a: str, b: str, pred=lambda g: True) -> list[tuple[str, float, float, str]]:
        return [row for g in by_case.get(case, []) if pred(g) and (row := _row(g, g["group"], a, b)) is not None]

    goals.append(_goal("forward vs packed SDPA (the limit)", "<= 1.02 at every case",
                       collect("1 forward", "headwise", "packed SDPA (limit)"), 1.02, notes.get("limit", "")))
    goals.append(_goal("fwd+bwd vs packed SDPA (the limit)", "<= 1.05 at every case",
                       collect("1 fwd+bwd", "headwise", "packed SDPA (limit)"), 1.05, notes.get("limit_bwd", "")))
    first = lambda g: (g["meta"]["d"], g["meta"]["s"]) == (768, 512)  # noqa: E731
    goals.append(_goal("forward vs nn.MultiheadAttention fast path at b8 s512 d768 h12", "<= 0.85",
                       collect("1 forward", "headwise", "nn.MHA fast path", first), 0.85, notes.get("mha", "")))
    hf = []
    for case in ("1 forward", "1 fwd+bwd"):
        for g in by_case.get(case, []):
            for e in g["entries"]:
                if e["name"].startswith("HF "):
                    ref = _ref_of(g, e)
                    hf.append(_pair_row(f"{g['group']} vs {e['name']}", ref, e))
    goals.append(_goal("vs every Hugging Face layer (BERT, Llama; sdpa and eager)", "<= 1.0", hf, 1.0,
                       notes.get("hf", "")))

    peaks = {}
    for g in by_case.get("6 matmul peak", []):
        key = (g["meta"]["b"], g["meta"]["s"], g["meta"]["d"])
        peaks[key] = max(e["flops"] / e["median_s"] for e in g["entries"])
    fractions = []
    for g in by_case.get("1 forward", []):
        m = g["meta"]
        key = (m["b"], m["s"], m["d"])
        hw = _entry(g, "headwise")
        if key in peaks and hw is not None and not m["causal"]:
            attn_share = 4 * m["b"] * m["s"] ** 2 * m["d"] / g["flops"]
            frac = g["flops"] / hw["median_s"] / peaks[key]
            fractions.append({"group": g["group"], "fraction": frac, "attention_share": attn_share,
                              "achieved_gflops": g["flops"] / hw["median_s"] / 1e9, "peak_gflops": peaks[key] / 1e9})
    proj = [(f["group"], f["fraction"]) for f in fractions if f["attention_share"] < 0.1]
    row = _goal("projection-dominated shapes vs measured fp32 matmul peak", ">= 90 % of peak",
                [(n, 1 / f) for n, f in proj], 1 / 0.9, notes.get("peak", ""))
    if proj:
        row["measured"] = ", ".join(f"{100 * f:.0f} % ({n})" for n, f in proj)
        row["detail"] = "; ".join(f"{f['group']}: {f['achieved_gflops']:.1f} of {f['peak_gflops']:.1f} GFLOP/s "
                                  f"({100 * f['fraction']:.0f} %)" for f in fractions)
        if not row["met"]:
            worst = min(f for _, f in proj)
            row["status"] = f"missed: {100 * worst:.0f} % of peak (goal 90 %)"
    goals.append(row)

    causal = collect("1 causal step", "attend(causal=True)", "attend() non-causal")
    goals.append(_goal("causal attention step vs non-causal (kernel's causal path, no s x s mask)",
                       "<= 0.7x", causal, 0.7, notes.get("causal", "")))
    goals.append(_goal("per-head weights vs nn.MHA(need_weights=True, average_attn_weights=False)", "<= 1.0",
                       collect("3 per-head weights", "headwise return_weights=True",
                               "nn.MHA need_weights, per head"), 1.0, notes.get("weights", "")))
    gqa = collect("2 GQA/MQA", "headwise", "packed SDPA repeat K/V") + collect(
        "2 GQA/MQA", "headwise attend", "repeat_interleave K/V + SDPA")
    row = _goal("GQA/MQA vs repeating K/V (and K/V never repeated in memory)", "<= 1.0", gqa, 1.0,
                notes.get("gqa", ""))
    sizes = [g["meta"] for g in by_case.get("2 GQA/MQA", []) if "kv_bytes_headwise" in g["meta"]]
    if sizes:
        row["detail"] += "; K/V held: " + ", ".join(
            f"{m['kind']} {m['kv_bytes_headwise'] / 2**20:.0f} MiB (repeated: {m['kv_bytes_repeated'] / 2**20:.0f} MiB)"
            for m in sizes) + "; SDPA's CPU kernel takes enable_gqa natively (no repeat_interleave in its profile)"
    goals.append(row)

    dec = by_case.get("4 decode", [])
    goals.append(_goal("decode vs minimal preallocated cache", "<= 1.05 per token",
                       collect("4 decode", "headwise", "minimal prealloc cache (limit)"), 1.05, notes.get("decode", "")))
    at4096 = collect("4 decode", "headwise", "torch.cat cache",
                     lambda g: g["meta"]["context"] == 4096 and g["meta"]["h_kv"] == g["meta"]["h"])
    goals.append(_goal("decode vs torch.cat-grown cache at context 4096 (d 4096, h 32)", "<= 0.5", at4096, 0.5,
                       notes.get("cat", "")))
    xw = collect("4 decode", "headwise", "x @ W preallocated loop")
    goals.append(_goal("decode vs x @ W preallocated loop (d 2048, h 16, context 2048)", "<= 1.00 per token", xw,
                       1.0, notes.get("decode_xw", "")))
    xw_huge = collect("4 decode", "headwise", "x @ W loop on huge pages")
    goals.append(_goal("decode vs the same x @ W loop on huge pages (placement equal)", "<= 1.02 per token", xw_huge,
                       1.02, notes.get("decode_xw_huge", "")))
    step = collect("4 decode", "headwise DecodeStep", "x @ W preallocated loop")
    goals.append(_goal("decode with headwise.DecodeStep vs x @ W preallocated loop", "<= 1.00 per token", step,
                       1.0, notes.get("decode_xw", "")))
    step_huge = collect("4 decode", "headwise DecodeStep", "x @ W loop on huge pages")
    goals.append(_goal("decode with headwise.DecodeStep vs the x @ W loop on huge pages", "<= 1.02 per token",
                       step_huge, 1.02, notes.get("decode_xw_huge", "")))
    hfd = []
    for g in dec:
        for e in g["entries"]:
            if e["name"].startswith("HF "):
                hfd.append(_pair_row(f"{g['group']} vs {e['name']}", _ref_of(g, e), e))
    goals.append(_goal("decode vs Hugging Face DynamicCache / StaticCache", "<= 1.0", hfd, 1.0,
                       notes.get("hf_dec", "")))
    graphs = {}
    for g in dec:
        e = _entry(g, "headwise torch.compile")
        if e is not None:
            graphs[(g["meta"]["h_kv"])] = e["compiled_graphs_so_far"]
    hf_graphs = {g["meta"]["h_kv"]: e["compiled_graphs_so_far"] for g in dec
                 if (e := _entry(g, "HF Llama StaticCache torch.compile")) is not None}
    rope_graphs = {g["meta"]["h_kv"]: e["compiled_graphs_so_far"] for g in dec
                   if (e := _entry(g, "headwise (RoPE) torch.compile")) is not None}
    for k, v in rope_graphs.items():
        graphs[f"{k} (RoPE)"] = v
    if graphs:
        worst = max(graphs.values())
        goals.append({"goal": "torch.compile decode compiles once for all positions and contexts", "target": "1 graph",
                      "measured": ", ".join(f"h_kv {k}: {v}" for k, v in graphs.items())
                                  + ("" if not hf_graphs else " (HF Llama StaticCache compiled: "
                                     + ", ".join(f"h_kv {k}: {v}" for k, v in hf_graphs.items()) + ")"),
                      "status": "met" if worst == 1 else f"missed: {worst} graphs", "met": worst == 1,
                      "detail": "decode graphs dynamo compiled over every decoded position of contexts "
                                + "/".join(str(c) for c in sorted({g["meta"]["context"] for g in dec
                                                                   if _entry(g, "headwise torch.compile")}))
                                + ", after one compiled 8-token prefill (1 more graph) as in generation. Decoding "
                                  "straight from an eagerly filled cache compiles 2 graphs in a fresh process (the "
                                  "first position is specialised: dynamo treats the Python int KVCache.length as "
                                  "static until it sees a second value), 1 with torch.compile(dynamic=True)",
                      "why": "" if worst == 1 else notes.get("compile", "")})
    else:
        goals.append({"goal": "torch.compile decode compiles once for all positions", "target": "1 graph",
                      "measured": "", "status": "not measured (compile disabled)", "detail": ""})

    if by_case.get("5 long forward"):
        goals.append(_long_goal(by_case, notes))
    mem = [m for m in memory if m.get("impl") == "headwise" and "error" not in m]
    if mem:
        top = max(mem, key=lambda m: m["s"])
        used = top["forward_peak_above_inputs"]
        met = used < GiB
        goals.append({"goal": f"memory: one forward at s {top['s']} (h {top['h']}, d_head {top['d_head']})",
                      "target": "< 1 GiB above inputs, never b*h*s^2 probabilities",
                      "measured": f"{used / GiB:.2f} GiB (materialising needs "
                                  f"{top['h'] * top['s'] ** 2 * 4 / GiB:.0f} GiB per s x s tensor)",
                      "status": "met" if met else f"missed by {100 * (used / GiB - 1):.0f} %", "met": met,
                      "detail": "; ".join(f"s {m['s']}: {m['forward_peak_above_inputs'] / GiB:.2f} GiB" for m in mem),
                      "why": "" if met else notes.get("memory", "")})
    else:
        goals.append({"goal": "memory: one forward at long context", "target": "< 1 GiB above inputs",
                      "measured": "", "status": "not measured", "detail": ""})
    goals.append(_gpu_goal(by_case, notes))
    goals += _trace_goals(by_case, notes)
    goals += _surgery_goals(by_case.get("8 surgery", []), notes)
    goals += _baseline_goals([g for c, gs in by_case.items() if c.startswith("baseline ") for g in gs], notes)
    patched = by_case.get("7 patched", [])
    if patched:
        goals.append(_goal("patched HF model vs the same model unpatched (forward, generate)", "<= 1.02",
                           [r for g in patched for e in g["entries"] if e["name"].startswith("HF ")
                            and (r := _row(g, g["group"], "headwise (patched)", e["name"]))], 1.02,
                           notes.get("patched", "")))
    return goals


def _baseline_goals(groups: list[dict], notes: dict[str, str]) -> list[dict]:
    """Issue 14's "no regression": every new layer against the old one in the same run (case ``baseline``); the
    old opt-in packed-GEMM decode (item 5) gets its own row."""
    if not groups:
        return []
    from .baseline import BASE

    rows, packed = [], []
    for g in groups:
        for e in g["entries"]:
            if e["name"].startswith(BASE) and e.get("vs"):
                row = _row(g, f"{g['group']}{e['name'][len(BASE):]}", e["vs"], e["name"])
                if row is not None:
                    (packed if e["name"].endswith("use_packed_gemm") else rows).append(row)
    out = [_goal(f"headwise vs {BASE} (the code of the RESULTS.md issues 14 and 15 measured against), same run",
                 "<= 1.02 at every case", rows, 1.02, notes.get("baseline", ""))]
    if packed:
        out.append(_goal(f"decode vs {BASE}'s opt-in packed GEMM (issue 14 item 5 removed it)", "<= 1.00 per token",
                         packed, 1.00, notes.get("baseline_packed", "")))
    return out


def _surgery_goals(groups: list[dict], notes: dict[str, str]) -> list[dict]:
    """Issue 18: the pruned layer's forward against the unpruned one; K/V-cache bytes after regrouping."""
    goals = []
    prune = [g for g in groups if g["meta"].get("mode") == "prune"]
    if prune:
        rows = []
        for g in prune:
            h = g["meta"]["h"]
            row = _row(g, g["group"], f"headwise {h // 2} of {h} heads", f"headwise {h} of {h} heads")
            if row is not None:
                rows.append(row)
        row = _goal("surgery: attention forward with half the heads removed vs unpruned", "<= 0.6", rows, 0.6,
                    notes.get("surgery", ""))
        row["detail"] += "; " + "; ".join(
            f"{e['name']}: {e['params']:,} parameters, {e['median_s'] * 1e3:.2f} ms" for g in prune for e in g["entries"])
        goals.append(row)
    for g in (g for g in groups if g["meta"].get("mode") == "kv"):
        h, h_kv = g["meta"]["h"], g["meta"]["h_kv"]
        ref = next(e for e in g["entries"] if e["n_kv_heads"] == h)
        ok = all(e["kv_cache_bytes"] * h == ref["kv_cache_bytes"] * e["n_kv_heads"] for e in g["entries"])
        goals.append({"goal": f"surgery: KV-cache bytes of the regrouped decoder ({g['group']})",
                      "target": "= n_kv_heads / n_heads of the MHA cache", "status": "met" if ok else "missed",
                      "met": ok, "measured": ", ".join(f"h_kv {e['n_kv_heads']}: {e['kv_cache_bytes'] / 2**20:.1f} MiB"
                                                       for e in g["entries"] if e["role"].startswith("headwise")),
                      "detail": "; ".join(f"{e['name']}: {e['kv_cache_bytes']:,} bytes, prefill "
                                          f"{e['median_s'] * 1e3:.1f} ms" for e in g["entries"]),
                      "why": "" if ok else notes.get("surgery_kv", "")})
    return goals


def _trace_goals(by_case: dict[str, list[dict]], notes: dict[str, str]) -> list[dict]:
    """Issue 16: capturing every head's result, its memory, and the patching sweep (case ``trace``)."""
    groups = by_case.get("trace", [])
    if not groups:
        return []
    result = [g for g in groups if g["group"].startswith("trace result")]
    sweep = [g for g in groups if g["group"].startswith("trace sweep")]
    goals = [_goal("trace: capture every head's result vs a plain forward", "<= 1.5",
                   [r for g in result if (r := _row(g, g["group"], "headwise trace result", "plain forward"))], 1.5,
                   notes.get("trace", "")),
             _goal("trace: every head's result vs TransformerLens run_with_cache", "<= 1.0 (faster)",
                   [r for g in result if (r := _row(g, g["group"], "headwise trace result",
                                                     "TransformerLens run_with_cache"))], 1.0, notes.get("tl", "")),
             _goal("trace: per-head patching sweep vs the brute-force loop", "<= 0.25",
                   [r for g in sweep if (r := _row(g, g["group"], "headwise head_effects", "brute-force loop"))], 0.25,
                   notes.get("sweep", ""))]
    for g in result:
        mem, size = g["meta"].get("memory", {}), g["meta"]["result_bytes"]
        if any("error" in m for m in mem.values()) or len(mem) < 2:
            goals.append({"goal": "trace: memory of capturing every head's result", "target": "<= result tensor + 10 %",
                          "measured": "", "status": "not measured", "detail": str(mem)})
            continue
        extra = mem["traced"]["peak_above_inputs"] - mem["plain"]["peak_above_inputs"]
        met = extra <= 1.1 * size
        goals.append({"goal": f"trace: memory of capturing every head's result ({g['group']})",
                      "target": "extra peak over the plain forward <= result tensor + 10 %",
                      "measured": f"{extra / 2**20:.0f} MiB extra; the result tensor is {size / 2**20:.0f} MiB",
                      "status": "met" if met else f"missed: {extra / size:.2f} x the result tensor", "met": met,
                      "detail": (f"peak above inputs: plain {mem['plain']['peak_above_inputs'] / 2**20:.0f} MiB, "
                                 f"traced {mem['traced']['peak_above_inputs'] / 2**20:.0f} MiB"),
                      "why": "" if met else notes.get("trace_memory", "")})
    return goals


def _gpu_goal(by_case: dict[str, list[dict]], notes: dict[str, str]) -> dict:
    name, target = "GPU bf16: headwise vs packed SDPA, SDPA and flash_attn_func", "<= 1.05 (optional, CUDA only)"
    rows = [_row(g, f"{g['group']} vs packed SDPA", "headwise", "packed SDPA (limit)")
            for g in by_case.get("gpu forward", [])]
    rows += [_row(g, f"{g['group']} vs {peer}", "headwise attend", peer)
             for g in by_case.get("gpu attention step", []) for peer in ("SDPA", "flash_attn_func")]
    rows = [row for row in rows if row is not None]
    if not rows:
        return {"goal": name, "target": target, "measured": "",
                "status": "not run: no CUDA device on the machine of this run (the case runs only where "
                          "torch.cuda.is_available())", "detail": ""}
    return _goal(name, target, rows, 1.05, notes.get("gpu", ""))


def _long_goal(by_case: dict[str, list[dict]], notes: dict[str, str]) -> dict:
    groups = by_case.get("5 long forward", [])
    rows = [row for g in groups if (row := _row(g, g["group"], "headwise", "packed SDPA (limit)")) is not None]
    row = _goal("long forward, queries chunked, vs packed SDPA (the limit)", "<= 1.05", rows, 1.05,
                notes.get("long", ""))
    extra = [f"{g['group']}: chunks of {g['meta'].get('query_chunk')} positions, {r:.3f}x one pass"
             for g in groups if (r := _ratio(g, "headwise", "headwise one pass")) is not None]
    if extra:
        row["detail"] += "; " + "; ".join(extra)
    return row


# -- files ------------------------------------------------------------------------------------------------------
def _md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _processes_text(machine: dict) -> list[str]:
    n = machine.get("processes", 1)
    if n <= 1:
        return []
    how = (f"the median of the per-round ratios over every round of the {n} processes" if machine.get("round_ratios")
           else f"the median of the {n} per-process ratios")
    return [f"Every timed case ran {n} times, one after the other, each time in a fresh process of its own "
            f"(memory rows: one process per row). Each process timed headwise and its peers side by side; a "
            f"ratio here is {how}, followed in tables and details by the range (lowest-highest) of the per-process "
            f"ratios, and a time is the median of the per-process medians (min and max over every round of every "
            f"process).", ""]


def write_results(out_dir: str | os.PathLike, machine: dict, groups: list[dict], memory: list[dict],
                  goals: list[dict], preamble: str = "", *, regression: dict | None = None) -> tuple[Path, Path]:
    """Write ``results.json`` (everything) and ``RESULTS.md`` (goals, the comparison with the previous run
    when ``regression`` is given (:func:`benchmarks.regression.compare_with_previous`), then every table)."""
    from .regression import regression_lines

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"machine": machine, "goals": goals, "groups": groups, "memory": memory}
    if regression is not None:
        data["regression"] = regression
    js = out / "results.json"
    js.write_text(json.dumps(data, indent=1, default=str) + "\n")
    m = machine
    parts = [
        "# Benchmark results", "",
        f"Produced by `{m['command']}` on {m['date_utc']}.", "",
        f"Machine: {m['cpu']}, {m['logical_cores']} logical cores, {m['threads']} torch threads; torch {m['torch']}, "
        f"transformers {m['transformers']}, Python {m['python']}; float32 on CPU"
        f"{' (quick sizes: not representative)' if m['quick'] else ''}.", "",
    ]
    if m.get("allocator"):
        parts += ["Allocator: glibc malloc pinned by " + ", ".join(f"`{k}={v}`" for k, v in m["allocator"].items())
                  + " (docs/benchmarks.md, \"Pinning the allocator\").", ""]
    if preamble:
        parts += [preamble, ""]
    parts += ["Ratios are headwise time / other time within one interleaved run on identical inputs "
              "(below 1: headwise is faster)"
              + (", taken round by round (the median of the per-round ratios)" if m.get("round_ratios") else "")
              + ". Times are medians over rounds (min and max shown); every peer holds "
              "the headwise layer's weights and its output is checked against headwise's on the warm-up call.",
              "", *_processes_text(m),
              "## Goals", "",
              _md_table(["goal", "target", "measured", "status"],
                        [[g["goal"], g["target"], g.get("measured", ""), g["status"]] for g in goals]), ""]
    missed = [g for g in goals if g.get("met") is False]
    if missed:
        parts += ["### Why the missed goals are missed", ""]
        for g in missed:
            parts.append(f"- **{g['goal']}** ({g['status']}): {g.get('why') or 'see the tables below.'}")
        parts.append("")
    parts += ["### Details per goal", ""]
    for g in goals:
        if g.get("detail"):
            parts.append(f"- {g['goal']}: {g['detail']}")
    parts.append("")
    if regression is not None:
        parts += regression_lines(regression)
    case = None
    for g in groups:
        if g["case"] != case:
            case = g["case"]
            parts += [f"## Case {case}", ""]
        parts += [f"### {g['group']}", ""]
        rounds = sorted({e['rounds'] for e in g['entries']})
        calls = ", ".join(f"{e['calls_per_round']}" for e in g["entries"])
        parts += [f"{'/'.join(map(str, rounds))} rounds; calls per round: {calls}; {g['threads']} threads.", ""]
        parts += [_md_table(TABLE_HEAD, group_table_rows(g)), ""]
        for n in g.get("notes", []):
            parts.append(f"- {n}")
        for e in g["entries"]:
            if e.get("note"):
                parts.append(f"- {e['name']}: {e['note']}")
        parts.append("")
    if memory:
        parts += ["## Case 5 memory", "",
                  "Peak RSS of one forward (no_grad, b 1) minus the RSS after weights and input were built; each row "
                  "is its own process.", ""]
        rows = []
        for r in memory:
            if "error" in r:
                rows.append([r["impl"], r["s"], r["h"], r["d_head"], "", "", "", "", r["error"]])
                continue
            rows.append([r["impl"], r["s"], r["h"], r["d_head"], f"{r['forward_peak_above_inputs'] / GiB:.3f}",
                         f"{r['output_bytes'] / GiB:.3f}", r.get("query_chunk") or "",
                         f"{r['forward_s']:.2f}" if "forward_s" in r else "",
                         f"{r['h'] * r['s'] ** 2 * 4 / GiB:.1f}"])
        parts += [_md_table(["impl", "s", "h", "d_head", "forward peak above inputs (GiB)", "output (GiB)",
                             "query chunk", "one forward (s, single run)",
                             "one (h, s, s) fp32 tensor (GiB) / error"], rows), ""]
    md = out / "RESULTS.md"
    md.write_text("\n".join(parts) + "\n")
    return md, js


def write_summary(path: str | os.PathLike, machine: dict, goals: list[dict], groups: list[dict],
                  memory: list[dict]) -> Path:
    """The README-ready summary: where each goal stands, with the machine and the command."""
    m = machine
    lines = [
        "## Performance", "",
        "`make bench` (`python -m benchmarks --processes 3` from the repository root, over two hours on 2 "
        "cores, most of it the long-context and memory cases: every timed case three times, each time in a fresh "
        "process of its own, see below; `python -m benchmarks` alone runs one process; `--quick` for a seconds-long check of "
        "the machinery, `--only forward,decode` or case numbers 1-6 for a subset, `--only gpu` for the optional "
        "CUDA case) runs headwise and every peer in one "
        "interleaved run on the same inputs with the same weights, checks that their outputs agree, prints a "
        "table per comparison and writes `benchmarks/RESULTS.md` and `benchmarks/results.json`. The peers: a "
        "minimal packed module (one fused QKV projection, `F.scaled_dot_product_attention`, merge, output "
        "projection) as the practical limit; `nn.MultiheadAttention` (fast path and default call); Hugging Face "
        "`BertSelfAttention` and `LlamaAttention` (sdpa and eager); for decoding a `torch.cat`-grown cache, a "
        "minimal preallocated cache (`nn.Linear`, and a plain loop with `x @ W` weights) and Hugging Face's "
        "DynamicCache/StaticCache; for GQA/MQA repeated K/V. The comparison with the previous "
        "`benchmarks/results.json` (headwise rows more than 2 % slower) is in `benchmarks/RESULTS.md`.", "",
        f"Last full run (`{m['command']}`, {m['date_utc']}): {m['cpu']}, {m['logical_cores']} cores shared with "
        f"other jobs during the run, {m['threads']} torch threads, torch {m['torch']}, float32 on CPU. Ratios are "
        "headwise time / peer time, medians over interleaved rounds (below 1: headwise is faster); "
        "'fastest rounds' is the same ratio of the minimum times, the least disturbed by the shared machine.", "",
        *_processes_text(m),
        _md_table(["goal", "target", "where it stands", "status"],
                  [[g["goal"], g["target"], g.get("measured", ""), g["status"]] for g in goals]), "",
    ]
    missed = [g for g in goals if g.get("met") is False]
    if missed:
        lines += ["Missed goals, and why:", ""]
        lines += [f"- **{g['goal']}**: {g.get('why') or g['status']}" for g in missed]
        lines.append("")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("\n".join(lines) + "\n")
    return p
