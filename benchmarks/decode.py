"""Case 4: per-token decode latency with a KV cache, eager and ``torch.compile``.

Every decoder starts each round from the same cache content (random keys/values of the context length,
untimed) and then decodes ``decode_tokens`` tokens; the time per token is the block time over the tokens.
Compiled entries share one compiled module over all contexts of a configuration, and count the graphs
dynamo compiled for them (the goal: one for every position). One more group decodes at ``Sizes.decode_xw``
(MHA, batch 1) against the same loop written with ``x @ W`` weights (:class:`~benchmarks.peers.XWDecoder`)
and the ``nn.Linear`` minimal cache.

Shapes:
    x: (1, 1, d) per token; cached keys/values: (1, h_kv, context, d_h).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from headwise import DecodeStep, KVCache, MultiHeadAttention, RotaryEmbedding

from . import peers
from .timing import Entry, Group, refresh_memory

__all__ = ["decode_groups", "CompileCounter"]


class CompileCounter:
    """Wraps a callable; counts the graphs dynamo compiles while it runs (``torch._dynamo`` stats)."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.graphs = fn, 0

    def __call__(self, *args, **kwargs):
        from torch._dynamo.utils import counters

        before = counters["stats"]["unique_graphs"]
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.graphs += counters["stats"]["unique_graphs"] - before


class _Shared:
    """Layers, peers, caches and compiled modules of one (d, h, h_kv) configuration, reused across contexts."""

    def __init__(self, sz, h_kv: int, hf_note: str | None) -> None:
        d, h, _, contexts = sz.decode
        torch.manual_seed(0)
        self.plain = MultiHeadAttention(d, h, h_kv).eval()
        self.max_len = max(contexts) + sz.decode_tokens * (sz.rounds + 4) + 8
        self.cache = self.plain.new_cache(1, self.max_len)
        self.prealloc = peers.PreallocDecoder(self.plain, 1, self.max_len).eval()
        self.cat = peers.CatCacheDecoder(self.plain).eval()
        self.cat.packed = self.prealloc.packed  # the same weights; one copy in memory
        self.hf_note = hf_note
        self.compiled: dict[str, CompileCounter] = {}
        if hf_note is None:
            self.rope = MultiHeadAttention(d, h, h_kv, bias=False, rotary=RotaryEmbedding(d // h)).eval()
            self.rope_cache = self.rope.new_cache(1, self.max_len)
            self.hf_built = peers._llama_layer(self.rope, "sdpa")  # one HF layer for every HF decoder here
        mods = [self.plain, self.cache, self.prealloc]
        if hf_note is None:
            mods += [self.rope, self.rope_cache, self.hf_built[1]]
        refresh_memory(*mods)
        self.prefill_graphs = None
        if sz.compile:
            # As in generation: the compiled module runs the prompt (prefill) and then every decode step. Dynamo
            # specialises on the first call; the second (new length, one query) makes the cache length and the
            # query length symbolic, so one more graph serves every decode position and context.
            self.cache_c = self.plain.new_cache(1, self.max_len)
            counter = CompileCounter(torch.compile(self.plain))
            with torch.no_grad():
                counter(torch.randn(1, 8, d), cache=self.cache_c)
            self.prefill_graphs, counter.graphs = counter.graphs, 0
            self.compiled["headwise"] = counter
            if hf_note is None:
                # The Llama-shaped headwise layer compiled the same way, against HF's compiled StaticCache layer.
                self.rope_cache_c = self.rope.new_cache(1, self.max_len)
                counter_r = CompileCounter(torch.compile(self.rope))
                with torch.no_grad():
                    counter_r(torch.randn(1, 8, d), cache=self.rope_cache_c)
                counter_r.graphs = 0
                self.compiled["headwise_rope"] = counter_r
                config, layer, rope = self.hf_built
                self.compiled["hf_static"] = CompileCounter(torch.compile(layer))
                self.hf_built_c = (config, self.compiled["hf_static"], rope)


def _fill(cache: KVCache, k: torch.Tensor, v: torch.Tensor) -> None:
    cache.reset()
    cache.update(k, v)


def _decode_group(sz, h_kv: int, ctx: int, shared: dict, hf_note: str | None) -> Group:
    d, h, _, _ = sz.decode
    if h_kv not in shared:
        shared.clear()
        shared[h_kv] = _Shared(sz, h_kv, hf_note)
    sh: _Shared = shared[h_kv]
    d_h = d // h
    torch.manual_seed(ctx)
    k0, v0 = torch.randn(1, h_kv, ctx, d_h), torch.randn(1, h_kv, ctx, d_h)
    x = torch.randn(1, 1, d)
    n = sz.decode_tokens
    nograd = torch.no_grad

    def hw_step(attn, cache):
        def f():
            with nograd():
                return attn(x, cache=cache)
        return f

    def module_step(m):
        def f():
            with nograd():
                return m(x)
        return f

    es = [
        Entry("headwise", hw_step(sh.plain, sh.cache), role="headwise", number=n,
              reset=partial(_fill, sh.cache, k0, v0)),
        Entry("minimal prealloc cache (limit)", module_step(sh.prealloc), role="limit", number=n,
              reset=partial(sh.prealloc.fill, k0, v0), note="fused QKV, attends over the filled prefix"),
        Entry("torch.cat cache", module_step(sh.cat), number=n, reset=partial(sh.cat.fill, k0, v0)),
    ]
    notes = []
    if sz.compile:
        counter = sh.compiled["headwise"]
        extra = {"compiled_graphs_so_far": lambda: counter.graphs, "prefill_graphs": sh.prefill_graphs}
        es.append(Entry("headwise torch.compile", hw_step(counter, sh.cache_c), role="headwise-compiled", number=n,
                        reset=partial(_fill, sh.cache_c, k0, v0), extra=extra,
                        note="one compiled module (after a compiled 8-token prefill) for every context and position "
                             "of this configuration; graphs = decode graphs compiled so far; its ratio column is eager "
                             "headwise / compiled headwise"))
    if hf_note is None:
        es.append(Entry("headwise (RoPE, no bias)", hw_step(sh.rope, sh.rope_cache), role="headwise2", number=n,
                        reset=partial(_fill, sh.rope_cache, k0, v0)))
        max_len = ctx + n * (sz.rounds + 4) + 8
        for kind in ("dynamic", "static"):
            fill, step = peers.llama_decoder(sh.rope, kind, 1, max_len, sh.hf_built)
            es.append(Entry(f"HF Llama {kind.capitalize()}Cache", partial(_call_no_grad, step, x),
                            ref="headwise (RoPE, no bias)", number=n, reset=partial(fill, k0, v0),
                            note="StaticCache sized to this context + the decoded tokens" if kind == "static"
                            else "grows by torch.cat"))
        if sz.compile:
            counter_r = sh.compiled["headwise_rope"]
            es.append(Entry("headwise (RoPE) torch.compile", hw_step(counter_r, sh.rope_cache_c),
                            role="headwise-compiled", ref="headwise (RoPE, no bias)", number=n,
                            reset=partial(_fill, sh.rope_cache_c, k0, v0),
                            extra={"compiled_graphs_so_far": lambda: counter_r.graphs}))
            counter_hf = sh.compiled["hf_static"]
            fill, step = peers.llama_decoder(sh.rope, "static", 1, sh.max_len, sh.hf_built_c)
            es.append(Entry("HF Llama StaticCache torch.compile", partial(_call_no_grad, step, x),
                            ref="headwise (RoPE) torch.compile", number=n, reset=partial(fill, k0, v0),
                            role="peer-compiled", extra={"compiled_graphs_so_far": lambda: counter_hf.graphs},
                            note=f"one compiled layer for every context; StaticCache of max_len {sh.max_len} "
                                 "(fixed, so one graph can serve every context), attended through a mask"))
    else:
        notes.append(f"Hugging Face caches skipped: {hf_note}")
    group = Group("4 decode", f"decode d{d} h{h} h_kv{h_kv} context {ctx}", es, rounds=sz.rounds, tol=(2e-4, 2e-5),
                  flops=None, meta={"d": d, "h": h, "h_kv": h_kv, "context": ctx, "tokens_per_round": n,
                                    "cache_max_len": sh.max_len})
    group.notes += notes
    return group


def _xw_group(sz, shared: dict) -> Group:
    """headwise with its own KVCache against the x @ W preallocated loop and the nn.Linear minimal cache."""
    shared.clear()  # the other configurations' layers are no longer needed
    d, h, ctx = sz.decode_xw
    n = sz.decode_tokens
    max_len = ctx + n * (sz.rounds + 4) + 8
    torch.manual_seed(0)
    attn = MultiHeadAttention(d, h).eval()
    cache = attn.new_cache(1, max_len)
    xw = peers.XWDecoder(attn, 1, max_len)
    xw_huge = peers.XWDecoder(attn, 1, max_len)
    prealloc = peers.PreallocDecoder(attn, 1, max_len).eval()
    step_cache = attn.new_cache(1, max_len)
    step = DecodeStep(attn, step_cache)  # the inference switch: checks and plan once, not per token
    refresh_memory(attn, cache, step_cache, xw, prealloc)
    refresh_memory(xw_huge, huge_pages=True)  # the same loop, its weights and cache advised as headwise's are
    d_h = d // h
    torch.manual_seed(ctx)
    k0, v0 = torch.randn(1, h, ctx, d_h), torch.randn(1, h, ctx, d_h)
    x = torch.randn(1, 1, d)

    def hw() -> torch.Tensor:
        with torch.no_grad():
            return attn(x, cache=cache)

    es = [
        Entry("headwise", hw, role="headwise", number=n, reset=partial(_fill, cache, k0, v0)),
        Entry("headwise DecodeStep", partial(_call_no_grad, step, x), number=n, reset=partial(_fill, step_cache, k0, v0),
              note="headwise.DecodeStep(attn, cache): the same layer and steps, its checks and plan made once"),
        Entry("x @ W preallocated loop", partial(_call_no_grad, xw, x), number=n, reset=partial(xw.fill, k0, v0),
              note="plain function: W (d_in, d_out) contiguous, addmm per projection, slot write, SDPA over "
                   "the filled prefix, merge, @ W_O"),
        Entry("x @ W loop on huge pages", partial(_call_no_grad, xw_huge, x), number=n,
              reset=partial(xw_huge.fill, k0, v0),
              note="the same loop with its weights and cache advised onto huge pages, as headwise allocates its own "
                   "(headwise.buffers): what placement alone is worth"),
        Entry("minimal prealloc cache (limit)", partial(_call_no_grad, prealloc, x), role="limit", number=n,
              reset=partial(prealloc.fill, k0, v0), note="nn.Linear, fused QKV, attends over the filled prefix"),
    ]
    # Four entries of a few tokens each: cheap, so six times the usual rounds (medians of 5 moved by +-3 %).
    return Group("4 decode", f"decode vs x @ W d{d} h{h} h_kv{h} context {ctx}", es, rounds=6 * sz.rounds,
                 tol=(2e-4, 2e-5), flops=None,
                 meta={"d": d, "h": h, "h_kv": h, "context": ctx, "tokens_per_round": n, "cache_max_len": max_len,
                       "peer": "x @ W"})


def _call_no_grad(step, x):
    with torch.no_grad():
        return step(x)


def decode_groups(sz, *, hf: bool = True) -> list[Callable[[], Group]]:
    hf_note = peers.hf_available() if hf else "Hugging Face peers disabled"
    d, h, kvs, contexts = sz.decode
    if sz.compile:
        # Up to 3 compiled modules x 2 configurations x (prefill + decode) graphs: above dynamo's default limit
        # of 8 graphs per function, past which it would silently fall back to eager.
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    shared: dict = {}
    out = []
    for h_kv in kvs:
        for ctx in contexts:
            out.append(partial(_decode_group, sz, h_kv, ctx, shared, hf_note))
    out.append(partial(_xw_group, sz, shared))
    return out
