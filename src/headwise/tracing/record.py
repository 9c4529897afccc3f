"""What one layer reported during a trace: :class:`LayerRecord`.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width, d_h: head width.
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention import MultiHeadAttention
from ..statistics import STATISTICS, concatenate
from .edits import CachePadding, DeferredPadding, real_positions

__all__ = ["LayerRecord", "CAPTURABLE", "TraceLookupError"]

CAPTURABLE = ("q", "k", "v", "pattern", "z", "result") + STATISTICS
_BY_POSITION = {"q": 2, "z": 1, "result": 1}  # the query-position axis: several calls concatenate along it
_TL_NAMES = {"q": "hook_q", "k": "hook_k", "v": "hook_v", "pattern": "hook_pattern", "z": "hook_z",
             "result": "hook_result"}
# TransformerLens names rotary layers' q and k twice: hook_q/hook_k before the rotation, hook_rot_q/hook_rot_k
# after it. A trace captures what the scores are computed from: after it.
_TL_ROTATED = {**_TL_NAMES, "q": "hook_rot_q", "k": "hook_rot_k"}


class TraceLookupError(KeyError, ValueError):
    """A layer or capture a trace does not have: a ``ValueError`` (bad input, named with what there is) and a
    ``KeyError`` (a failed lookup, as ``t[name]`` reads)."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


class _Link:
    """One call in a record's chain of calls not yet read back (:meth:`LayerRecord.add`)."""

    __slots__ = ("call", "padding", "queries", "next")

    def __init__(self, call: dict, padding: Any, queries: int) -> None:
        self.call, self.padding, self.queries, self.next = call, padding, queries, None


class LayerRecord:
    """What one layer reported during a trace: ``.q``, ``.k``, ``.v``, ``.pattern``, ``.z``, ``.result``.

    Each is the tensor the layer's forward used (after every edit), so with autograd on
    ``torch.autograd.grad(loss, t[i].z)`` is the gradient at that tensor. After several calls (decoding)
    ``q``, ``z``, ``result``, ``lse``, ``entropy`` and ``max_weight`` are concatenated along the query positions
    and ``key_weight`` is summed per key position (:func:`headwise.statistics.concatenate`); ``calls`` holds every
    call's dict; ``paddings`` holds each call's real-token mask (the model's ``attention_mask``; a decoder layer's of an
    encoder-decoder model: its ``decoder_attention_mask``) or None, where a 3-D or 4-D mask was given as a
    :class:`~headwise.tracing.edits.DeferredPadding` read into one on the first mean that needs it.

    Shapes:
        q (b, h, s_q, d_h); k, v (b, h_kv, s, d_h) (h where a k/v edit gave every query head its own copy);
        pattern (b, h, s_q, s_kv); z (b, s_q, h, d_h); result (b, s_q, h, d); lse, entropy, max_weight
        (b, h, s_q); key_weight (b, h, s_kv)
    """

    def __init__(self, index: int, name: str, layer: MultiHeadAttention, capture: frozenset[str]) -> None:
        self.index, self.name, self.layer, self.capture = index, name, layer, capture
        self._calls: list[dict[str, torch.Tensor]] = []
        self._paddings: list[Any] = []
        self._queries: list[int] = []
        # Calls made in compiled code arrive on a chain (add) and join the lists when read: such code only links
        # a new node, so dynamo never guards on how many calls the lists hold (one graph for every decode step).
        self._head = self._tail = _Link({}, None, 0)
        #: A decoder layer of an encoder-decoder model: ``paddings`` are the decoder's (its queries' tokens),
        #: which its keys need not share (cross-attention reads the encoder's).
        self.decoder = False
        #: A call recorded here was cross-attention (its module given an encoder's states, in any model): its
        #: keys are that sequence's, not ``paddings``' tokens.
        self.cross = False

    def _read(self) -> None:
        node = self._head.next
        while node is not None:
            self._calls.append(node.call)
            self._paddings.append(node.padding)
            self._queries.append(node.queries)
            node = node.next
        self._head.next, self._tail = None, self._head

    @property
    def calls(self) -> list[dict[str, torch.Tensor]]:
        """Every call's captures, in order."""
        self._read()
        return self._calls

    @property
    def paddings(self) -> list[Any]:
        """Each call's real-token mask (see the class docstring), in order."""
        self._read()
        return self._paddings

    @property
    def queries(self) -> list[int]:
        """Each call's query count: key_weight sums over calls only where the keys line up (concatenate)."""
        self._read()
        return self._queries

    def add(self, call: dict[str, torch.Tensor], padding: Any, queries: int) -> None:
        """Record one call: its captures, its padding and its query count (in compiled code, on the chain the
        lists take in when next read)."""
        if torch.compiler.is_compiling():
            node = _Link(call, padding, queries)
            self._tail.next = node
            self._tail = node
            return
        self._read()
        self._calls.append(call)
        self._paddings.append(padding)
        self._queries.append(queries)

    def __getstate__(self) -> dict[str, Any]:
        self._read()  # a copy or pickle holds the lists, never a chain to walk recursively
        return dict(self.__dict__)

    def drop_last(self) -> None:
        """Forget the last call recorded (its layer failed after recording it)."""
        self._read()
        for kept in (self._calls, self._paddings, self._queries):
            kept.pop()

    def clear(self) -> None:
        """Forget every call (a trace entered again starts empty)."""
        self._read()
        self.cross = False
        for kept in (self._calls, self._paddings, self._queries):
            kept.clear()

    def _require(self, what: str) -> None:
        """Refuse ``what`` unless it is capturable, captured and the layer was called."""
        if what not in CAPTURABLE:
            raise TraceLookupError(f"{what!r} is not capturable; choose from {CAPTURABLE}")
        if what not in self.capture:
            raise TraceLookupError(f"layer {self.index} ({self.name!r}) did not capture {what!r}: it captured "
                           f"{sorted(self.capture) or 'nothing'}; pass capture=(..., {what!r})")
        if not self.calls:
            raise ValueError(f"layer {self.index} ({self.name!r}) was not called inside the trace")

    def require_one_call(self, what: str, read: str = "calls[i]") -> None:
        """Refuse (ValueError naming ``what``, the layer and its calls) a layer that ran more than once in one
        forward: one module shared by several blocks (ALBERT's layer, ``nn.Sequential([attn] * 3))``), whose
        calls a per-layer sweep or attribution would join along the positions as if they were one.

        Args:
            what: the caller, for the message.
            read: what the message tells the user to read instead, after ``t[index].``."""
        if len(self.calls) > 1:
            raise ValueError(f"{what}: layer {self.index} ({self.name!r}) ran {len(self.calls)} times in one forward "
                             "(one module shared by several blocks, as in ALBERT), so its heads are not one site "
                             f"each: trace the model and read each call's own tensors, t[{self.index}].{read}")

    def get(self, what: str) -> torch.Tensor:
        """The captured ``what`` (one of :data:`CAPTURABLE`)."""
        self._require(what)
        if what == "result" and any(what not in c for c in self.calls):  # taken at W_O's call (LayerTracer.watch)
            raise ValueError(f"layer {self.index} ({self.name!r}): a call's 'result' was never taken: its W_O module "
                             "was not called after its heads (the forward failed before it)")
        if len(self.calls) == 1:
            return self.calls[0][what]
        if what in STATISTICS:
            # the last entries: a cleared record (session) keeps appending after its earlier calls' counts
            queries = self.queries[-len(self.calls):] if len(self.queries) >= len(self.calls) else None
            return concatenate(what, [c[what] for c in self.calls], queries)
        if what not in _BY_POSITION:
            raise ValueError(f"layer {self.index} ran {len(self.calls)} times (e.g. decoding) and {what!r} of "
                             f"several calls is not joined, since their key lengths may differ: use "
                             f".calls[i][{what!r}] (Trace.as_dict(call=i) for every layer's)")
        parts, axis = [c[what] for c in self.calls], _BY_POSITION[what]
        first = parts[0].shape[:axis] + parts[0].shape[axis + 1:]
        for i, t in enumerate(parts[1:], 1):
            if t.shape[:axis] + t.shape[axis + 1:] != first:
                raise ValueError(f"layer {self.index} ({self.name!r}): {what!r} of its calls are joined along the "
                                 f"query positions (axis {axis}), so every other axis must agree, but call 0 is "
                                 f"{tuple(parts[0].shape)} and call {i} is {tuple(t.shape)} (calls of different "
                                 f"batch sizes); use .calls[i][{what!r}]")
        return torch.cat(parts, dim=axis)

    q = property(lambda self: self.get("q"), doc="Queries after rotary (b, h, s_q, d_h).")
    k = property(lambda self: self.get("k"), doc="Keys (b, h_kv, s, d_h).")
    v = property(lambda self: self.get("v"), doc="Values (b, h_kv, s, d_h).")
    pattern = property(lambda self: self.get("pattern"), doc="Probabilities (b, h, s_q, s_kv).")
    z = property(lambda self: self.get("z"), doc="Per-head context after edits (b, s_q, h, d_h).")
    result = property(lambda self: self.get("result"), doc="Per-head writes through W_O, z_h @ W_O^h (b, s_q, h, d): "
                      "what enters the residual stream unless the model normalises the attention output first.")
    lse = property(lambda self: self.get("lse"), doc="Each row's log-sum-exp of its scores, sinks included "
                   "(b, h, s_q); -inf where a row may read nothing.")
    entropy = property(lambda self: self.get("entropy"), doc="Each row's entropy over its keys, natural log "
                       "(b, h, s_q).")
    max_weight = property(lambda self: self.get("max_weight"), doc="Each row's largest weight (b, h, s_q).")
    key_weight = property(lambda self: self.get("key_weight"), doc="Each key's weight summed over the query rows "
                          "of every call (b, h, s_kv).")

    def mean(self, site: str = "z") -> torch.Tensor:
        """Each head's mean ``site`` vector over every call, batch row and real token (the model's
        ``attention_mask``, or its ``decoder_attention_mask`` in an encoder-decoder's decoder layers, whose k
        and v are refused as their keys may be either sequence's, as are those of a layer called as
        cross-attention in any model; every position when there was none), e.g. a
        mean-ablation value taken on other data: ``edit={(layer, head): reference[layer].mean()[head]}``.

        k and v count each real key position once. The first call, and every call whose keys are its own tokens
        (no cache, or a prefill), counts all its keys; a later call whose keys also hold a cache's earlier
        positions (a decoding step) counts only its new ones, its last ``queries`` keys, as captured in it, when
        the calls before it reached exactly those earlier positions at the same batch size; any other such call
        (a sliding window, another sequence's cache) is refused with a ``ValueError``.

        Shapes: -> (h, d_h) for q and z; (h_kv, d_h) for k and v (h under a k/v edit's own copies)
        """
        if site not in ("q", "k", "v", "z"):
            raise ValueError(f"mean: site must be one of q, k, v, z, got {site!r}")
        self._require(site)  # joining the calls is not needed (k and v of a decode differ in length)
        keys = site in ("k", "v")
        if self.decoder and keys:
            raise ValueError(f"mean: layer {self.index} ({self.name!r}) is a decoder layer of an encoder-decoder "
                             f"model, whose {site} positions are the decoder's tokens (self-attention) or the "
                             "encoder's (cross-attention): whose padding to average over is unknown; average "
                             f"t[{self.index}].{site} over the real positions yourself")
        if self.cross and keys:
            raise ValueError(f"mean: layer {self.index} ({self.name!r}) was called as cross-attention, whose {site} "
                             "positions are another sequence's (the encoder's) tokens, not those of the attention_mask "
                             f"the trace read: average t[{self.index}].{site} over the encoder's real positions "
                             "yourself")
        where = f"mean of layer {self.index} {site}"
        calls = self.calls
        total, count, reach, batch = None, 0.0, 0, None
        for j, (call, padding, queries) in enumerate(zip(calls, self.paddings, self.queries[-len(calls):])):
            x = call[site] if site == "z" else call[site].transpose(1, 2)  # (b, s, heads, d_h)
            b, s = x.shape[:2]
            flat = x.detach().double().reshape(b, s, -1)  # (b, s, heads * d_h)
            if isinstance(padding, DeferredPadding):
                padding = padding.resolve()  # once: the length below reads it too
            real = real_positions(padding, flat, where, site)  # (b, s) or None
            if keys:
                # Keys [0, length) are the sequence's positions 0.. (a static cache's later slots are empty); a
                # decoding step's new keys are its last `queries` ones, the earlier ones counted by earlier calls.
                length = padding.tokens.shape[1] if isinstance(padding, CachePadding) else s
                start = length - queries
                if start > 0 and j > 0:  # the first call counts all its keys: none was counted before
                    if start != reach or b != batch:
                        raise ValueError(
                            f"{where}: call {j} attends over {length} key positions for its {queries} queries, so "
                            f"its first {start} keys are not its own tokens, but they do not continue the "
                            f"{reach} positions the calls before it reached at batch {batch} (this call: batch "
                            f"{b}): a sliding window, a cache of another sequence, or keys of another sequence "
                            "(cross-attention), so which of its keys earlier calls counted is unknown and "
                            "counting them again would weight them more; trace one sequence per trace, or "
                            f"average t[{self.index}].calls[{j}][{site!r}] over its real positions yourself")
                    flat = flat[:, start:length]  # (b, queries, heads * d_h): this call's new keys
                    real = None if real is None else real[:, start:length]
                reach, batch = length, b
            w = flat.new_ones(flat.shape[:2]) if real is None else real.to(flat.device, torch.float64)  # (b, s)
            summed = (flat * w.unsqueeze(-1)).sum((0, 1))  # (heads * d_h,)
            total = summed if total is None else total + summed
            count += float(w.sum())
        return (total / max(count, 1.0)).view(x.shape[2], x.shape[3]).to(x.dtype)

    def tl_names(self) -> dict[str, str]:
        """``{TransformerLens hook name: capture name}`` for what this layer captured: q and k of a layer with
        rotary embeddings (``layer.rotary``: its own; or a patched module that rotates them before handing them
        over, ``layer.rotated``, whether or not its family's registry entry names its rotary) are captured after
        the rotation, TransformerLens' ``hook_rot_q`` / ``hook_rot_k``."""
        layer = self.layer
        rotated = getattr(layer, "rotated", False) is True or getattr(layer, "rotary", None) is not None
        names = _TL_ROTATED if rotated else _TL_NAMES
        return {f"blocks.{self.index}.attn.{name}": c for c, name in names.items() if c in self.capture}

    def __repr__(self) -> str:
        return (f"LayerRecord({self.index}, {self.name!r}, capture={sorted(self.capture)}, "
                f"calls={len(self.calls)})")
