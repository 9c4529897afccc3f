"""The object a traced layer calls (``MultiHeadAttention.tracer``): edits, then captures, for every trace
active on the layer (nested traces stack: the outer trace's edits first, then the inner's; every trace
captures the tensors the forward then uses).

Shapes:
    q (b, h, s_q, d_h); k, v (b, h_kv, s_kv, d_h); weights (b, h, s_q, s_kv); z (b, h, s_q, d_h)
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention import MultiHeadAttention
from ..statistics import STATISTICS
from .checkpointing import backward_task, recompute_refusal
from .edits import DeferredPadding, SitePlan, Unseen, apply
from .layers import head_results
from .record import LayerRecord

__all__ = ["LayerTracer", "Entry"]


def _no_tracer() -> None:
    return None


class Entry:
    """One active trace on one layer: its record, its per-site plans and its session (for the padding)."""

    def __init__(self, session: Any, record: LayerRecord, plans: dict[str, SitePlan], decoder: bool = False,
                 blind: bool = False) -> None:
        self.session, self.record, self.plans, self.decoder = session, record, plans, decoder
        self.blind = blind  # the traced module takes no attention_mask (one patched layer, a plain wrapper)
        self.pending: dict[str, torch.Tensor] = {}
        #: The mask reaching the layer in the running call of its patched host module (padding.watch_hosts).
        self.reached: DeferredPadding | Unseen | None = None

    @property
    def padding(self) -> Any:
        """The real-token mask of the sequence this layer's queries come from: an encoder-decoder's decoder
        layers read the decoder's tokens, never the encoder's ``attention_mask``. In a call the trace's
        pre-hook did not see, or when the traced module shows no mask of its own, the mask that reached the
        layer, where a patched host module showed it."""
        padding = self.session.decoder_padding if self.decoder else self.session.padding
        if self.reached is not None and not self.decoder and (
                isinstance(padding, Unseen) or (padding is None and self.blind)):
            return self.reached
        return padding


def _weighted(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``weights @ v`` per head, query head i reading V head i // g. Shapes: (b, h, s_q, s_kv), (b, h_kv, s_kv,
    d_v) -> (b, h, s_q, d_v)"""
    b, h, s_q, s_kv = weights.shape
    h_kv = v.shape[1]
    z = weights.reshape(b, h_kv, h // h_kv * s_q, s_kv) @ v.to(weights.dtype)  # (b, h_kv, g * s_q, d_v)
    return z.view(b, h, s_q, v.shape[-1])


class LayerTracer:
    """A layer's tracer while one or more traces are active on it.

    A copy of a traced layer (``copy.deepcopy``, pickling, the surgery functions' copies) gets no tracer:
    every copy hook answers None, so the copy runs untraced.
    """

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.last_results: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] | None = None
        self.recorded: list = []  # the records the last context step appended a call to (discard)

    # -- a copy of a traced layer is not traced ----------------------------------------------------------
    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __copy__(self) -> None:
        return None

    def __reduce__(self) -> tuple:
        return (_no_tracer, ())

    # -- the protocol the layer calls --------------------------------------------------------------------
    def wants_weights(self, layer: MultiHeadAttention) -> bool:
        return any("pattern" in e.record.capture or e.plans["pattern"] for e in self.entries)

    def wants_statistics(self, layer: MultiHeadAttention) -> tuple[str, ...]:
        entries = self.entries
        return tuple(n for n in STATISTICS if any(n in e.record.capture for e in entries))

    def statistics(self, layer: MultiHeadAttention, values: dict[str, torch.Tensor]) -> None:
        self.stats = values  # captured by the context step that follows

    def qkv(self, layer: MultiHeadAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):  # type: ignore[no-untyped-def]
        entries = self.entries
        # A call inside a backward is a checkpoint's recompute (checkpointing.py): refused before it computes
        # or records anything. Compiled code never runs a layer's Python in a backward.
        # Both torch checkpoints recompute with autograd on: a no-grad call from a backward hook is no recompute.
        if entries and torch.is_grad_enabled() and not torch.compiler.is_compiling() and backward_task() != -1:
            raise ValueError(recompute_refusal(entries[0].record.index, entries[0].record.name))
        self.recorded = []  # a new call: an earlier one's records are never discarded by this one's failure
        given = k, v
        if any(e.plans["k"] or e.plans["v"] for e in entries) and k.shape[1] != q.shape[1]:
            g = q.shape[1] // k.shape[1]  # each query head its own K/V copy: an edit touches that head's view
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (b, h, s_kv, d_h)
        for e in entries:
            plans, padding = e.plans, e.padding
            if plans["q"]:
                q = apply(plans["q"], q, padding)
            if plans["k"]:
                k = apply(plans["k"], k, padding)
            if plans["v"]:
                v = apply(plans["v"], v, padding)
        # k and v may be a cache's own storage (a static cache hands over its whole buffer), which later calls
        # write in place: a capture holds a copy, and the forward uses that copy so that it is still the tensor
        # the call used (its gradient too). An edit's output is new already; q, z and the pattern are always new.
        if k is given[0] and any("k" in e.record.capture for e in entries):
            k = k.clone()
        if v is given[1] and any("v" in e.record.capture for e in entries):
            v = v.clone()
        for e in entries:
            e.pending = {n: t for n, t in (("q", q), ("k", k), ("v", v)) if n in e.record.capture}
        self.values = v if self.wants_weights(layer) else None
        return q, k, v

    def context(self, layer: MultiHeadAttention, z: torch.Tensor,
                weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(z, weights)`` after the traces' edits: under a pattern edit both are the edited ones, so the
        probabilities the layer returns are those its output was computed from."""
        entries = self.entries
        values, self.values = self.values, None
        stats, self.stats = self.stats, None
        edited = [e for e in entries if e.plans["pattern"]]
        if weights is not None and (edited or (torch.is_grad_enabled() and self.wants_weights(layer))):
            for e in edited:
                weights = apply(e.plans["pattern"], weights, e.padding)
            usable = values is not None and values.shape[2] == weights.shape[-1] \
                and not (layer.training and layer.config.dropout > 0)
            if usable:  # z from the (edited) probabilities: the captured pattern is the tensor z was made of
                z = _weighted(weights, values)
            elif edited:
                raise ValueError(f"a pattern edit needs every value the layer attends over and no dropout; this "
                                 f"call attends over {weights.shape[-1]} positions and saw "
                                 f"{None if values is None else values.shape[2]} values (a bare layer "
                                 "decoding with a KVCache), or runs dropout in training mode")
        for e in entries:
            if e.plans["z"]:
                z = apply(e.plans["z"], z, e.padding)
        if any("z" in e.record.capture for e in entries):
            zc = z.transpose(1, 2)  # (b, s_q, h, d_h): what is captured is what W_O reads
            z = zc.transpose(1, 2)
        results = None
        if any("result" in e.record.capture for e in entries):
            results = head_results(z, layer.out_proj.weight)  # (b, s_q, h, d)
        self.recorded = []  # as in qkv: only this call's records are ever discarded
        for e in entries:
            call, e.pending = e.pending, {}
            capture = e.record.capture
            if "pattern" in capture:
                call["pattern"] = weights
            if "z" in capture:
                call["z"] = zc
            if "result" in capture:
                call["result"] = results
            if stats is not None:
                call.update((n, t) for n, t in stats.items() if n in capture)
            if capture:
                e.record.add(call, e.padding, z.shape[2])
                self.recorded.append(e.record)
        self.last_results = results
        return z, weights

    def discard(self, layer: MultiHeadAttention) -> None:
        """Forget the call the context step just recorded: the layer failed after it (W_O, a hook) and rolled
        its cache back, so the trace holds only the calls that completed, as the cache does."""
        recorded, self.recorded = self.recorded, []
        self.last_results = None
        for record in recorded:
            record.drop_last()

    def results(self, layer: MultiHeadAttention) -> torch.Tensor | None:
        """The head writes the context step just captured, handed over once (the layer sums them instead of
        a second W_O product), or None. Patched modules call ``project_out`` themselves and never ask."""
        results, self.last_results = self.last_results, None
        return results
