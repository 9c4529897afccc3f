"""The benchmark's peer snippets capture the same tensors as headwise (and the sweep's the same effects), at a
tiny size; a peer that is not installed is skipped naming the extra that installs it."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from functools import partial

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import stats_peers, sweep, trace  # noqa: E402
from benchmarks.cases import QUICK  # noqa: E402


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} not installed (pip install headwise[peers])")


@pytest.fixture(scope="module")
def models():
    d, h, layers, vocab, _, s = QUICK.trace
    return trace.gpt2_models(d, h, layers, vocab, s)


def _inputs(models):
    d, h, layers, vocab, b, s = QUICK.trace
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(3))
    w_o = [blk.attn.c_proj.weight.detach().view(h, d // h, d) for blk in models["plain"].h]
    return ids, w_o


@pytest.mark.parametrize("capture", [("result",), ("pattern", "z")])
@pytest.mark.parametrize("peer", ["hooks", "tl_cache", "tl_hooks", "nnsight", "pyvene"])
def test_peer_captures_equal_headwise(models, peer, capture):
    module = {"tl_cache": "transformer_lens", "tl_hooks": "transformer_lens"}.get(peer, peer)
    if module != "hooks":
        _need(module)
    ids, w_o = _inputs(models)
    pattern = "pattern" in capture
    run = {"hooks": partial(trace._hooks, models["eager" if pattern else "plain"], ids, capture, w_o),
           "tl_cache": lambda: trace._tl_cache(models.get("tl"), ids, capture),
           "tl_hooks": lambda: trace._tl_hooks(models.get("tl"), ids, capture),
           "nnsight": lambda: trace._nnsight(models["nnsight eager" if pattern else "nnsight"], ids, capture, w_o),
           "pyvene": lambda: (trace._pyvene_pattern(models["pyvene eager"], ids, capture, w_o) if pattern
                              else trace._pyvene(models["pyvene"], ids, capture, w_o))}[peer]
    got, want = run(), trace._headwise(models["patched"], ids, capture)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


# b2 puts each patched copy's rows at j * b .. (j + 1) * b, which b1 cannot tell from j
@pytest.mark.parametrize("sizes", [QUICK, replace(QUICK, sweep=(64, 4, 3, 256, 2, 8))], ids=["b1", "b2"])
@pytest.mark.parametrize("peer", ["hooks", "tl", "nnsight", "pyvene"])
def test_sweep_peer_equals_head_effects(peer, sizes):
    if peer != "hooks":
        _need({"tl": "transformer_lens"}.get(peer, peer))
    group = sweep._group(sizes)
    fns = {e.name: e.fn for e in group.entries}
    name = {"hooks": "hooks, a batch per layer", "tl": "TransformerLens run_with_hooks", "nnsight": "nnsight",
            "pyvene": "pyvene"}[peer]
    want = fns["headwise head_effects"]()
    assert want.shape == (sizes.sweep[2], sizes.sweep[1]) and bool(want.abs().sum() > 0)
    torch.testing.assert_close(fns[name](), want, rtol=1e-4, atol=1e-5)


def test_stats_peers_times_only_the_call_not_the_heap_cleanup_before_it(monkeypatch):
    import gc
    import time

    # peak_rss_above collects garbage first; made 0.5 s slow here, a no-op call must still measure ~0
    monkeypatch.setattr(stats_peers, "_tool", lambda name: lambda ids: None)
    monkeypatch.setattr(gc, "collect", lambda *a: time.sleep(0.5))
    row = stats_peers.measure("plain", 8)
    assert row["tool"] == "plain" and row["s"] == 8 and row["seconds"] < 0.25
