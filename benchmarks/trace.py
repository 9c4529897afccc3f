"""Case ``trace``: what seeing every head costs (issue 16).

* ``trace result``: a forward that captures every head's residual write (``headwise.trace(capture=
  ("result",))``, h GEMMs after the fused attention) vs the plain forward of the same layer; plus the
  extra peak memory of the traced forward over the plain one (each measured in a fresh process, RSS
  high-water mark as in :mod:`benchmarks.memory`) against the size of the result tensor itself.
* ``trace sweep``: :func:`headwise.patching.head_effects` (batched over heads) vs the brute-force loop of
  one traced forward per (layer, head), on all-MiniLM-L6-v2 (6 x 12 heads; a tiny random BERT at quick
  sizes), metric: cosine of two sentences' mean-pooled embeddings.
* TransformerLens 3.9.0 (the dev extra installs it beside our pins): the same layer as a one-layer
  attention-only ``HookedTransformer`` (:func:`benchmarks.peers.transformer_lens_twin`), ``run_with_cache``
  keeping only ``hook_result``, in the result group; without TransformerLens, issue 16's figure is cited.

Run one memory measurement by hand: ``python -m benchmarks.trace traced 8 512 768 12``.

Shapes:
    x: (b, s, d); result: (b, s, h, d); b: batch, s: sequence, d: d_model, h: heads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial

import torch

import headwise
from headwise import MultiHeadAttention
from .peers import transformer_lens_twin
from .timing import Entry, Group, forward_flops

__all__ = ["trace_groups", "measure_memory", "SENTENCES"]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SENTENCES = (["A man is playing a guitar.", "A woman is playing a violin."],
             ["A man is eating some bread.", "A woman is playing a violin."])
TL_FIGURE = ("TransformerLens 3.9.0 run_with_cache, all 12 heads' residual writes of a GPT-2-small-sized layer "
             "(b8 s512): 7.2-12.4 s and 10 GB (figure cited from issue 16, not measured here)")


def _plain(layer: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return layer(x)


def _traced(layer: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), headwise.trace(layer, capture=("result",)) as t:
        y = layer(x)
    t[0].result  # noqa: B018 - the capture is part of what is timed
    return y


def _transformer_lens(model, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    hook = "blocks.0.attn.hook_result"
    with torch.no_grad():
        resid, cache = model.run_with_cache(x, start_at_layer=0, stop_at_layer=1, names_filter=hook)
    cache[hook]  # noqa: B018 - every head's result, (b, s, h, d), as headwise's capture
    return resid - x  # the block returns input + attention output


def _child(kind: str, b: int, s: int, d: int, h: int) -> dict:
    from .memory import _peak_bytes, _reset_peak, _rss_bytes

    torch.manual_seed(0)
    layer = MultiHeadAttention(d, h).eval()
    x = torch.randn(b, s, d)
    run = _traced if kind == "traced" else _plain
    run(layer, x[:1, :8])  # warm code paths outside the measurement
    reset = _reset_peak()
    base = _rss_bytes()
    with torch.no_grad():
        if kind == "traced":
            with headwise.trace(layer, capture=("result",)) as t:
                layer(x)
            kept = t[0].result
        else:
            kept = layer(x)
    peak = _peak_bytes()
    del kept
    return {"kind": kind, "peak_above_inputs": max(0, peak - base), "reset_peak": reset}


def measure_memory(kind: str, b: int, s: int, d: int, h: int, timeout: float = 600.0) -> dict:
    """Peak RSS of one ``kind`` ("plain" / "traced") forward above its inputs, in a fresh process."""
    cmd = [sys.executable, "-m", "benchmarks.trace", kind, str(b), str(s), str(d), str(h)]
    try:
        out = subprocess.run(cmd, cwd=_ROOT, capture_output=True, text=True, timeout=timeout, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"kind": kind, "error": f"{type(exc).__name__}: {exc}"}


def _result_group(sz, shape: tuple[int, int, int, int]) -> Group:
    b, s, d, h = shape
    torch.manual_seed(0)
    layer = MultiHeadAttention(d, h).eval()
    x = torch.randn(b, s, d)
    es = [Entry("headwise trace result", partial(_traced, layer, x), role="headwise",
                note="capture=('result',): every head's z_h W_O^h, (b, s, h, d)"),
          Entry("plain forward", partial(_plain, layer, x), role="limit", note="the same layer, no trace")]
    notes = []
    try:
        twin = transformer_lens_twin(layer, n_ctx=s)
    except ImportError:
        notes.append(TL_FIGURE)
    else:
        es.append(Entry("TransformerLens run_with_cache", partial(_transformer_lens, twin, x), role="peer",
                        note="transformer_lens 3.9.0 HookedTransformer, attention only, use_attn_result=True, "
                             "names_filter='blocks.0.attn.hook_result'"))
    memory = {kind: measure_memory(kind, b, s, d, h) for kind in ("plain", "traced")}
    result_bytes = b * s * h * d * 4
    cfg = layer.config
    return Group("trace", f"trace result b{b} s{s} d{d} h{h}", es, rounds=sz.rounds, block_s=sz.block_s,
                 tol=(1e-5, 1e-5), flops=forward_flops(b, s, d, cfg.inner_dim, cfg.kv_dim),
                 meta={"b": b, "s": s, "d": d, "h": h, "result_bytes": result_bytes, "memory": memory}, notes=notes)


def _sweep_model(real: bool):  # type: ignore[no-untyped-def]
    import transformers

    from headwise.interop import patch

    if real:
        try:
            from headwise.viz.maps import load_minilm

            tok, model = load_minilm()
            enc = [dict(tok(p, return_tensors="pt")) for p in SENTENCES]
            return "all-MiniLM-L6-v2", patch(model), enc[0], enc[1]
        except ImportError:
            pass
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                  intermediate_size=32, max_position_embeddings=32)
    torch.manual_seed(0)
    model = patch(transformers.BertModel(cfg).eval())
    ids = torch.randint(3, 40, (2, 2, 7))
    ids[1, 1] = ids[0, 1]
    return "tiny random BERT", model, {"input_ids": ids[0]}, {"input_ids": ids[1]}


def similarity(out) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Cosine of the two sentences' mean-pooled embeddings (rows 0 and 1, no padding)."""
    e = out.last_hidden_state.mean(1)
    return torch.nn.functional.cosine_similarity(e[0], e[1], dim=0)


def brute_force(model, clean: dict, corrupted: dict) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The sweep as a loop: one traced forward per (layer, head), the clean z given as a replacement."""
    with torch.no_grad(), headwise.trace(model, capture=("z",)) as t:
        model(**clean)
    with torch.no_grad():
        base = float(similarity(model(**corrupted)))
    heads = [r.layer.n_heads for r in t]
    out = torch.empty(len(heads), max(heads), dtype=torch.float64)
    for li, h in enumerate(heads):
        for i in range(h):
            with torch.no_grad(), headwise.trace(model, edit={(li, i): t[li].z[:, :, i]}):
                out[li, i] = float(similarity(model(**corrupted))) - base
    return out


def _sweep_group(sz) -> Group:
    from headwise.patching import head_effects

    real = sz.forward[0][2] >= 384
    name, model, clean, corrupted = _sweep_model(real)
    n_layers, h = model.config.num_hidden_layers, model.config.num_attention_heads
    es = [Entry("headwise head_effects", partial(head_effects, model, clean, corrupted, similarity), role="headwise",
                note=f"2 + {n_layers} forwards of batch {h} x 2, the prefix before each patched layer run once"),
          Entry("brute-force loop", partial(brute_force, model, clean, corrupted), role="peer",
                note=f"2 + {n_layers * h} forwards of batch 2")]
    return Group("trace", f"trace sweep {name} {n_layers}x{h}", es, rounds=sz.rounds, block_s=sz.block_s,
                 tol=(1e-5, 1e-5), meta={"model": name, "layers": n_layers, "heads": h})


def trace_groups(sz) -> list:
    """Factories of the trace case: the result capture at ``sz.forward[0]`` and the patching sweep."""
    return [partial(_result_group, sz, sz.forward[0]), partial(_sweep_group, sz)]


if __name__ == "__main__":
    kind, *dims = sys.argv[1:]
    print(json.dumps(_child(kind, *map(int, dims))))
