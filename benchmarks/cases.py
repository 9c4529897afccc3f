"""The layer-level groups: forward (full and causal), fwd+bwd, GQA and one-token decode, at :class:`Sizes`.

Every builder returns a zero-argument factory: a group's layers and inputs exist only while it runs. Peers
get the headwise layer's weights (:mod:`benchmarks.peers`), so each group's outputs must agree.

Shapes:
    b: batch, s: sequence, d: d_model, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from headwise import DecodeStep, KVCache, MultiHeadAttention

from . import peers
from .timing import Entry, Group

__all__ = ["Sizes", "FULL", "QUICK", "layer_groups"]


@dataclass(frozen=True)
class Sizes:
    forward: tuple[int, int, int, int]  # (b, s, d, h): forward, causal and fwd+bwd
    gqa: tuple[int, int, int, int, int]  # (b, s, d, h, h_kv)
    decode: tuple[int, int, int, int]  # (d, h, context, tokens per block)
    trace: tuple[int, int, int, int, int, int]  # GPT-2-shaped (d, h, layers, vocab, b, s)
    sweep: tuple[int, int, int, int, int, int]  # the patching sweep's GPT-2 (d, h, layers, vocab, b, s)
    bert: tuple[int, int, int, int, int]  # (d, h, layers, intermediate, vocab)
    llama: tuple[int, int, int, int, int, int]  # (d, h, h_kv, layers, intermediate, vocab)
    family: tuple[int, int, int, int, int]  # (d, h, layers, intermediate, vocab) of every other family
    hf_batch: tuple[int, int]  # (b, s) of the patched forwards
    generate: tuple[int, int]  # (prompt length, new tokens)
    prefill: tuple[int, int]  # (b, s) of the surgery case's cached prefill (its decoder: llama)
    rounds: int
    decode_rounds: int
    stats: tuple[int, int, int, int, int]  # the statistics group's GPT-2 (d, h, layers, b, s)
    stats_rounds: int  # its calls take seconds each
    sweep_rounds: int  # the sweep's calls take seconds each: fewer rounds keep the full run in minutes
    block_s: float


FULL = Sizes(forward=(8, 512, 768, 12), gqa=(1, 2048, 2048, 16, 4), decode=(2048, 16, 2048, 8),
             trace=(768, 12, 4, 50257, 2, 384), sweep=(768, 12, 12, 50257, 1, 32),
             bert=(512, 8, 4, 2048, 8192),
             llama=(1024, 16, 4, 4, 2816, 8192), family=(512, 8, 2, 1024, 4096), hf_batch=(4, 128), generate=(32, 16),
             prefill=(4, 256),
             rounds=10, decode_rounds=40, sweep_rounds=3, block_s=0.25, stats=(768, 12, 4, 1, 8192), stats_rounds=3)
QUICK = Sizes(forward=(2, 32, 64, 4), gqa=(1, 64, 128, 8, 2), decode=(64, 4, 16, 4),
              trace=(64, 4, 2, 256, 2, 16), sweep=(64, 4, 2, 256, 1, 8),
              bert=(64, 4, 2, 128, 256), llama=(64, 4, 2, 2, 128, 256),
              family=(64, 4, 2, 128, 256), hf_batch=(2, 16), generate=(4, 4), prefill=(1, 8), rounds=3, decode_rounds=6,
              sweep_rounds=3, block_s=0.01, stats=(64, 4, 2, 1, 128), stats_rounds=3)


def _no_grad(f: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def g() -> torch.Tensor:
        with torch.no_grad():
            return f()
    return g


def _layer(d: int, h: int, h_kv: int | None = None) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(d_model=d, n_heads=h, n_kv_heads=h_kv).eval()


def _shape(b: int, s: int, d: int, h: int) -> str:
    return f"b{b} s{s} d{d} h{h}"


def forward_group(sz: Sizes, causal: bool) -> Group:
    """headwise vs the packed SDPA module and nn.MultiheadAttention's fast path (eval, no grad)."""
    b, s, d, h = sz.forward
    attn = _layer(d, h)
    packed, mha = peers.PackedSDPA(attn).eval(), peers.mha_peer(attn).eval()
    x = torch.randn(b, s, d)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1) if causal else None  # nn.MHA: True = may not attend
    es = [Entry("headwise", _no_grad(lambda: attn(x, causal=causal))),
          Entry("packed SDPA", _no_grad(lambda: packed(x, causal=causal)), note="the practical limit"),
          Entry("nn.MultiheadAttention fast path", _no_grad(lambda: mha(
              x, x, x, need_weights=False, attn_mask=mask, is_causal=causal)[0]), note="eval, no_grad")]
    name = "forward causal" if causal else "forward"
    return Group(name, f"{name} {_shape(b, s, d, h)}", es, base="packed SDPA", rounds=sz.rounds,
                 block_s=sz.block_s)


def backward_group(sz: Sizes) -> Group:
    """Forward + backward to the input and every parameter, headwise vs the packed SDPA module."""
    b, s, d, h = sz.forward
    attn = _layer(d, h).train()
    packed = peers.PackedSDPA(attn).train()
    x = torch.randn(b, s, d, requires_grad=True)
    grad = torch.randn(b, s, d)

    def train(layer: torch.nn.Module) -> Callable[[], tuple[torch.Tensor, ...]]:
        params = list(layer.parameters())
        return lambda: torch.autograd.grad(layer(x), [x, *params], grad)[:1]  # d x is compared

    es = [Entry("headwise", train(attn)), Entry("packed SDPA", train(packed), note="the practical limit")]
    return Group("fwd+bwd", f"fwd+bwd {_shape(b, s, d, h)}", es, base="packed SDPA", rounds=sz.rounds,
                 block_s=sz.block_s, tol=(5e-4, 5e-5), notes=["outputs compared: the gradient to the input"])


def gqa_group(sz: Sizes) -> Group:
    """A grouped-query forward: headwise vs SDPA's native GQA and vs K/V repeated to every query head."""
    b, s, d, h, h_kv = sz.gqa
    attn = _layer(d, h, h_kv)
    native, repeat = peers.PackedSDPA(attn).eval(), peers.PackedSDPA(attn, repeat_kv=True).eval()
    x = torch.randn(b, s, d)
    es = [Entry("headwise", _no_grad(lambda: attn(x))),
          Entry("packed SDPA enable_gqa", _no_grad(lambda: native(x)), note="the practical limit"),
          Entry("packed SDPA repeat K/V", _no_grad(lambda: repeat(x)), note="repeat_interleave before SDPA")]
    return Group("gqa", f"GQA forward {_shape(b, s, d, h)} h_kv{h_kv}", es, base="packed SDPA enable_gqa",
                 rounds=sz.rounds, block_s=sz.block_s)


def _rewind(cache: KVCache, ctx: int) -> Callable[[], None]:
    """The headwise entries' reset: back to ``ctx`` cached positions, the context rewritten with its own values,
    so that each block starts with its cache as freshly written as the loop's (whose ``fill`` copies it)."""
    saved = cache.keys[:, :, :ctx].clone(), cache.values[:, :, :ctx].clone()

    def rewind() -> None:
        cache.crop(ctx)
        cache.keys[:, :, :ctx].copy_(saved[0])
        cache.values[:, :, :ctx].copy_(saved[1])

    return rewind


def decode_group(sz: Sizes) -> Group:
    """One token per call against a cache of ``context`` tokens: headwise ``attn(x, cache=cache)`` under
    no_grad vs the preallocated ``x @ W`` loop, and that loop over the layer's own ``nn.Linear`` weights (what
    their layout costs, reported beside the goal). Every block starts from the same cache content."""
    d, h, ctx, tokens = sz.decode
    attn = _layer(d, h)
    max_len = ctx + tokens + 1
    cache = attn.new_cache(batch_size=1, max_len=max_len)
    xw = peers.XWDecoder(attn, 1, max_len)
    lin = peers.LinearDecoder(attn, 1, max_len)
    torch.manual_seed(1)
    prompt, x = torch.randn(1, ctx, d), torch.randn(1, 1, d)
    with torch.no_grad():
        attn(prompt, cache=cache)  # the cached context, written by the forward itself
        k0, v0 = (p(prompt).view(1, ctx, h, d // h).transpose(1, 2) for p in (attn.k_proj, attn.v_proj))
    rewind = _rewind(cache, ctx)

    def step() -> torch.Tensor:
        with torch.no_grad():
            return attn(x, cache=cache)

    def xw_step() -> torch.Tensor:
        with torch.no_grad():
            return xw(x)

    es = [Entry("headwise", step, reset=rewind, number=tokens,
                note="attn(x, cache=cache) under no_grad"),
          Entry("x @ W preallocated loop", xw_step, reset=partial(xw.fill, k0, v0), number=tokens,
                note="addmm per projection, slot write, SDPA over the filled prefix, @ W_O"),
          Entry("F.linear preallocated loop", _no_grad(lambda: lin(x)), reset=partial(lin.fill, k0, v0),
                number=tokens, note="the same loop over the layer's own (d_out, d_in) weights: their layout's cost")]
    return Group("decode", f"decode d{d} h{h} context {ctx}", es, base="x @ W preallocated loop",
                 rounds=sz.decode_rounds, block_s=sz.block_s)


def decode_step_group(sz: Sizes) -> Group:
    """A d64 layer's one-token step, where a call's fixed Python cost is most of it: ``DecodeStep`` (checked and
    planned once) vs the preallocated ``x @ W`` loop."""
    d, h, ctx = 64, 4, 256
    attn = _layer(d, h)
    max_len = ctx + 64
    cache = attn.new_cache(batch_size=1, max_len=max_len)
    step = DecodeStep(attn, cache)
    xw = peers.XWDecoder(attn, 1, max_len)
    torch.manual_seed(1)
    prompt, x = torch.randn(1, ctx, d), torch.randn(1, 1, d)
    with torch.no_grad():
        attn(prompt, cache=cache)
        k0, v0 = (p(prompt).view(1, ctx, h, d // h).transpose(1, 2) for p in (attn.k_proj, attn.v_proj))
    es = [Entry("headwise DecodeStep", _no_grad(lambda: step(x)), reset=_rewind(cache, ctx), number=32,
                note="step = DecodeStep(attn, cache); step(x) under no_grad"),
          Entry("x @ W preallocated loop", _no_grad(lambda: xw(x)), reset=partial(xw.fill, k0, v0), number=32)]
    return Group("decode step", f"decode step d{d} h{h} context {ctx} (per-call overhead)", es,
                 base="x @ W preallocated loop", rounds=sz.decode_rounds, block_s=sz.block_s)


def layer_groups(sz: Sizes) -> dict[str, list[Callable[[], Group]]]:
    """Factories of the layer-level cases, by case name."""
    return {"forward": [partial(forward_group, sz, False), partial(forward_group, sz, True)],
            "backward": [partial(backward_group, sz)], "gqa": [partial(gqa_group, sz)],
            "decode": [partial(decode_group, sz), partial(decode_step_group, sz)]}
