"""Case 5, timed: a long-context forward, where headwise runs its queries in chunks (headwise.chunking).

Case 5's memory rows show what chunking saves; these groups show what it costs in time: headwise (chunked,
its default without autograd at this size), the same layer in one pass (``chunk_queries = False``) and the
packed SDPA module (the limit), interleaved on the same input, non-causal and causal.

Shapes:
    x: (b, s, d); b: batch, s: sequence, d: d_model, h: heads.
"""

from __future__ import annotations

import copy
from functools import partial

import torch

from headwise import MultiHeadAttention
from . import peers
from .timing import Entry, Group, forward_flops, refresh_memory

__all__ = ["long_groups"]


def _no_grad_call(layer: torch.nn.Module, x: torch.Tensor, causal: bool) -> torch.Tensor:
    with torch.no_grad():
        return layer(x, causal=causal)


def _long_group(sz, shape: tuple[int, int, int, int], causal: bool) -> Group:
    b, s, d, h = shape
    torch.manual_seed(0)
    chunked = MultiHeadAttention(d, h).eval()
    one_pass = copy.deepcopy(chunked)
    one_pass.chunk_queries = False
    packed = peers.PackedSDPA(chunked).eval()
    refresh_memory(chunked, one_pass, packed)
    x = torch.randn(b, s, d)
    with torch.no_grad():
        info = chunked.explain_dispatch(x, causal=causal)
    cfg = chunked.config
    flops = forward_flops(b, s, d, cfg.inner_dim, cfg.kv_dim, causal)
    chunk = info.query_chunk
    es = [
        Entry("headwise", partial(_no_grad_call, chunked, x, causal), role="headwise",
              note=f"queries in chunks of {chunk} positions" if chunk else "one pass (below the chunking threshold)"),
        Entry("headwise one pass", partial(_no_grad_call, one_pass, x, causal), note="chunk_queries = False"),
        Entry("packed SDPA (limit)", partial(_no_grad_call, packed, x, causal), role="limit"),
    ]
    notes = [f"causal via: {info.causal_via}"] if causal else []
    return Group("5 long forward", f"long fwd b{b} s{s} d{d} h{h} {'causal' if causal else 'full'}", es,
                 rounds=sz.long_rounds, block_s=0.0, tol=(2e-4, 2e-5), flops=flops,
                 meta={"b": b, "s": s, "d": d, "h": h, "causal": causal, "query_chunk": chunk}, notes=notes)


def long_groups(sz) -> list:
    """Factories of the timed long-context groups (one per shape of ``sz.long``, non-causal and causal)."""
    return [partial(_long_group, sz, shape, causal) for shape in sz.long for causal in (False, True)]
