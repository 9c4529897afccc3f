"""The object a traced layer calls (``MultiHeadAttention.tracer``): edits, then captures, for every trace
active on the layer (nested traces stack: the outer trace's edits first, then the inner's; every trace
captures the tensors the forward then uses).

Shapes:
    q (b, h, s_q, d_h); k, v (b, h_kv, s_kv, d_h); weights (b, h, s_q, s_kv); z (b, h, s_q, d_h)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention import MultiHeadAttention
from ..statistics import STATISTICS
from .checkpointing import backward_task, recompute_refusal
from .edits import DeferredPadding, OtherSequence, SitePlan, Unseen, apply
from .layers import head_results
from .padding import InertWhenCopied
from .record import LayerRecord

__all__ = ["LayerTracer", "Entry", "watch_w_o"]


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
        #: In a cross-attention call of that host, the keys' padding (another sequence's: refused); else None.
        self.key_padding: OtherSequence | None = None

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


def _w_o_module(layer: MultiHeadAttention) -> nn.Module | None:
    """The module whose call applies ``layer``'s W_O: a patched layer's located ``out_proj`` source, else a
    layer's own ``out_proj`` (a view of ``nn.MultiheadAttention`` calls the host's); None where W_O is no module
    (a functional W_O) or not located."""
    sources = getattr(layer, "sources", None)
    out = next((m for name, m in sources() if name == "out_proj"), None) if callable(sources) else None
    if out is None:
        try:
            out = layer.out_proj
        except (AttributeError, ValueError):  # a view whose W_O was not located
            return None
    return out if isinstance(out, nn.Module) else None


class _TakeResults(InertWhenCopied):
    """A trace's forward pre-hook on the module applying a layer's W_O, registered after that module's own: the
    'result' captures of the call that just attended are computed here, from W_O as the module's call applies it
    (after the hooks that set it: ``torch.nn.utils.weight_norm``'s recomputation, an offload bringing it in)."""

    def __init__(self, tracer: "LayerTracer", layer: MultiHeadAttention, name: str) -> None:
        self.tracer, self.layer, self.name = tracer, layer, name

    def __call__(self, module: nn.Module, args: tuple) -> None:
        waiting, self.tracer.waiting = self.tracer.waiting, None
        if waiting is None:
            return
        z, calls = waiting
        weight = self.layer.out_proj.weight  # (d, h * d_h), read now: the hooks before this one may replace it
        if weight.is_meta and not z.is_meta:
            raise ValueError(f"trace: capture 'result' of {self.name}: W_O's weight is still on the meta device when "
                             "its module is called (offloaded, and brought in inside its forward), so no head's write "
                             "can be read off it; capture 'z' and apply W_O yourself")
        results = head_results(z, weight)  # (b, s_q, h, d)
        for call in calls:
            call["result"] = results


def watch_w_o(layer: MultiHeadAttention, name: str) -> nn.Module | None:
    """For a layer capturing 'result': the module applying its W_O where that module's call runs hooks (which may
    set W_O: ``torch.nn.utils.weight_norm``, an offload), so the trace computes each head's write at that call
    (:meth:`LayerTracer.watch`); None where W_O's weight read during the attention is the one applied. Raises
    ``ValueError`` where W_O's weight is on the meta device and no hook of its module may bring it in (accelerate's
    offload replaces the module's forward): read during the attention, no write could be computed."""
    module = _w_o_module(layer)
    if module is None:
        return None
    if module._forward_pre_hooks or nn.modules.module._global_forward_pre_hooks:  # they run before W_O applies
        return module
    if layer.out_proj.weight.is_meta and "forward" in vars(module):  # a model on meta alone computes on meta
        raise ValueError(f"trace: capture 'result' of {name}: W_O's weight is on the meta device (offloaded, e.g. by "
                         "accelerate's cpu_offload or a device_map offload, which brings it in only inside its "
                         "module's own forward), so no head's write can be read off it; load the model without "
                         "offloading, or capture 'z' and apply W_O yourself")
    return None


def _refuse_cached_means(entries: list[Entry]) -> None:
    """Refuse a k or v "mean" edit in a call whose layer joins k and v to its own KVCache: the call sees only
    its new keys, so a decoding step would average those alone and the edited keys would be written into the
    cache (raised before the write: the cache is left as it was)."""
    for e in entries:
        for site in ("k", "v"):
            if e.plans[site].means:
                raise ValueError(f"{e.plans[site].means[0]}: 'mean' of k or v averages over every key the layer "
                                 "attends over, but a bare layer called with a KVCache sees only the call's new "
                                 "keys (and would write the averaged ones into the cache); call the layer on the "
                                 "whole prefix without a cache (causal=True), or pass ('mean', reference) or a "
                                 "tensor of the means, which edit each position alone")


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
        #: Where W_O's module runs hooks (watch): its pre-hook's handle, and (z, the call dicts capturing 'result')
        #: of the call that attended last, which that module's next call fills in.
        self.watching: Any = None
        self.waiting: tuple[torch.Tensor, list[dict]] | None = None

    def watch(self, layer: MultiHeadAttention, module: nn.Module, name: str) -> None:
        """Compute 'result' captures at the call of ``module`` (:func:`watch_w_o`), by a pre-hook registered after
        its own, until :meth:`close` (once for every trace on the layer)."""
        if self.watching is None:
            self.watching = module.register_forward_pre_hook(_TakeResults(self, layer, name))

    def close(self) -> None:
        """The last trace on the layer ended: remove the hook :meth:`watch` registered."""
        if self.watching is not None:
            self.watching.remove()
        self.watching = self.waiting = None

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

    def qkv(self, layer: MultiHeadAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            cached: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v)`` after the traces' edits, captured; ``cached``: the layer joins k and v to its own KVCache
        after this step."""
        entries = self.entries
        if cached:
            _refuse_cached_means(entries)
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
            if plans["k"] or plans["v"]:
                keys = padding if e.key_padding is None else e.key_padding  # a cross-attention call: the encoder's
                if plans["k"]:
                    k = apply(plans["k"], k, keys)
                if plans["v"]:
                    v = apply(plans["v"], v, keys)
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
        # Where W_O's module runs hooks, its call computes them (_TakeResults) from W_O as that call applies it.
        deferred = self.watching is not None
        waiting: list[dict] | None = [] if deferred else None
        if not deferred and any("result" in e.record.capture for e in entries):
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
                if waiting is not None:
                    waiting.append(call)
                else:
                    call["result"] = results
            if stats is not None:
                call.update((n, t) for n, t in stats.items() if n in capture)
            if capture:
                if e.key_padding is not None:
                    e.record.cross = True
                e.record.add(call, e.padding, z.shape[2])
                self.recorded.append(e.record)
        if deferred:  # replaced, never added to: a call that failed before W_O is never given a later call's
            self.waiting = (z, waiting) if waiting else None
        self.last_results = results
        return z, weights

    def discard(self, layer: MultiHeadAttention) -> None:
        """Forget the call the context step just recorded: the layer failed after it (W_O, a hook) and rolled
        its cache back, so the trace holds only the calls that completed, as the cache does."""
        recorded, self.recorded = self.recorded, []
        self.last_results = self.waiting = None
        for record in recorded:
            record.drop_last()

    def results(self, layer: MultiHeadAttention) -> torch.Tensor | None:
        """The head writes the context step just captured, handed over once (the layer sums them instead of
        a second W_O product), or None. Patched modules call ``project_out`` themselves and never ask."""
        results, self.last_results = self.last_results, None
        return results
