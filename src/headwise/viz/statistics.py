"""Every head of a model at long context, from per-head statistics (no pattern): :class:`HeadStatistics`.

:func:`model_statistics` runs a model once under ``headwise.trace(model, capture=("lse", "entropy",
"max_weight", "key_weight"))`` (:mod:`headwise.statistics`: never more than a bounded chunk of any head's
pattern in memory) and keeps, for one batch row, every layer x head's

* entropy and max weight of each query position (natural log; a sink's share is on no key),
* key weight of each key position (its weight summed over every query that reads something),

from which :meth:`HeadStatistics.grid` gives the three numbers per head drawn as a grid: the mean entropy, the
mean max weight (both over the rows that read something) and the first-token share (the mean weight on the first
real position, the first the ``attention_mask`` marks as a token, over the rows that read something other than
it: a causal model's first query may read only that token, so its 1.0 says nothing of the head, and is left out
as the pattern table leaves it out). A "sink" head puts most of its weight there, and a "sharp" one a large
weight on one key; each is judged against what uniform attention over each row's readable keys would give
(:meth:`HeadStatistics.uniform`): uniform causal attention puts ``mean_i 1 / (i + 1)`` on the first token,
0.42 at 3 tokens, and has a mean max weight of 0.61 there, which fixed thresholds alone would call a sink or
sharp. A head is one only where its number is past :data:`SINK_SHARE` (:data:`SHARP_WEIGHT`) and covers at least
:data:`EXCESS` of the way from uniform's number to 1, so uniform attention is neither at any length. A padding query row (``attention_mask`` 0) reads
nothing during the call (:func:`padding_reads_nothing`): under an eager model's ``finfo.min`` mask it would read
every key evenly, and under an encoder's right padding the real keys, so the share is one of the real rows'
attention (at most 1) and the same as the unpadded text's. :meth:`HeadStatistics.kinds` names the sink heads
and the sharp ones.

After head surgery (:mod:`headwise.surgery`) every head a layer kept is there, under its number before surgery,
as the pattern drawings number it: head ``k`` of the arrays is original head ``k`` in every layer, and the cells
of heads a layer does not hold (removed, or never there: layers of different head counts) are NaN.
:attr:`HeadStatistics.heads` lists each layer's heads; a layer whose every head was removed holds none (the
placeholder head surgery leaves in it is not a head of the model and is left out).

Shapes:
    L: layers, h: head numbers (the most of any layer; after surgery, the largest original number + 1),
    s: positions (queries and keys: self-attention).
"""

from __future__ import annotations

import numbers

from dataclasses import dataclass
from typing import Any

import torch

from .statistics_calls import counting_readable, padding_reads_nothing

__all__ = ["HeadStatistics", "model_statistics", "padding_reads_nothing", "SINK_SHARE", "SHARP_WEIGHT", "EXCESS"]

#: A head is a sink head when its first-token share is at least this (and :data:`EXCESS` holds).
SINK_SHARE = 0.5
#: A head is sharp when its mean max weight is at least this (and :data:`EXCESS` holds, and it is no sink head).
SHARP_WEIGHT = 0.5
#: ...and its number x is at least this far from uniform attention's u towards 1: (x - u) / (1 - u) >= EXCESS.
#: With 1/3 an encoder of 4 tokens or more is judged by the thresholds alone (u <= 1/4 there).
EXCESS = 1 / 3


@dataclass
class HeadStatistics:
    """Per-position statistics of every layer x head of one sequence.

    Attributes:
        tokens: the positions' labels.
        entropy, max_weight: (L, h, s) per query position (0 where a row reads nothing).
        key_weight: (L, h, s) per key position, summed over the query positions that read something.
        reading: (s,) bool: query positions that read something (not padding; padding rows read nothing).
        model: the model's name, for titles.
        heads: per layer, the number of each head it holds, in the layer's order now (after head surgery the
            numbers before it; ``()`` for a layer whose every head was removed). None: every layer holds heads
            0 .. h - 1. The arrays' cells of heads a layer does not hold are NaN.
        readable: (L, s) per query position, the number of keys it may read (by the mask and causality its
            layer was called with). None: every reading position may read every reading position (an encoder).
        reads_first: (L, s) bool, whether each query position may read the first real token (False past a
            sliding window). None: all may.

    Shapes:
        entropy, max_weight, key_weight: (L, h, s); reading: (s,); readable, reads_first: (L, s)
    """

    tokens: list[str]
    entropy: torch.Tensor
    max_weight: torch.Tensor
    key_weight: torch.Tensor
    reading: torch.Tensor
    model: str = ""
    heads: tuple[tuple[int, ...], ...] | None = None
    readable: torch.Tensor | None = None
    reads_first: torch.Tensor | None = None

    def __repr__(self) -> str:
        kept = "" if self.heads is None else ", after head surgery"
        # one line, as the other main objects print: the dataclass default would print every tensor
        model = f"model={self.model!r}, " if self.model else ""
        from .numbers import plural

        return (f"HeadStatistics({model}{plural(self.n_layers, 'layer')} x {plural(self.n_heads, 'head')}{kept}, "
                f"{plural(len(self.tokens), 'token')} ({int(self.reading.sum())} reading), arrays (L, h, s) "
                f"{tuple(self.entropy.shape)})")

    @property
    def n_layers(self) -> int:
        return self.entropy.shape[0]

    @property
    def n_heads(self) -> int:
        """The head numbers (the arrays' h): after head surgery, the largest original number + 1."""
        return self.entropy.shape[1]

    def held(self, layer: int) -> tuple[int, ...]:
        """The numbers of the heads layer ``layer`` holds, in its order now."""
        return tuple(range(self.n_heads)) if self.heads is None else tuple(self.heads[layer])

    def pairs(self) -> list[tuple[int, int]]:
        """Every (layer, head) held, layer by layer (each layer's heads in its order now)."""
        return [(layer, head) for layer in range(self.n_layers) for head in self.held(layer)]

    def check_pairs(self, pairs: list[tuple[int, int]]) -> None:
        """``ValueError`` naming the first of ``pairs`` that is not a (layer, head) these statistics hold;
        ``TypeError`` for one that is not two ints (a float would pass ``head in held`` and fail at indexing)."""
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2
                    and all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in pair)):
                raise TypeError(f"heads must be (layer, head) pairs of ints, got {pair!r}")
            layer, head = pair
            if not 0 <= layer < self.n_layers:
                raise ValueError(f"layer must be in [0, {self.n_layers}), got ({layer}, {head})")
            if head not in self.held(layer):
                from .numbers import span

                held = span(sorted(self.held(layer))) or "none (head surgery removed every one)"
                raise ValueError(f"layer {layer} has no head {head}: its heads are {held}")

    def grid(self) -> dict[str, torch.Tensor]:
        """``{"mean entropy", "mean max weight", "first-token share"}``, each (L, h): means over the rows that
        read something."""
        rows = self.reading.to(self.entropy.dtype)
        n = max(float(rows.sum()), 1.0)
        only, counted = self._rows()
        # a row that may read only the first token gives it all the weight it gives any key (its max weight,
        # below 1 only under attention sinks): taken back out of the key's sum
        first_weight = self.key_weight[..., self._first()] - (self.max_weight * only[:, None, :]).sum(-1)
        m = counted.sum(-1, keepdim=True).to(self.entropy.dtype)  # (L, 1)
        share = torch.where(m > 0, first_weight / m.clamp_min(1), torch.full_like(first_weight, float("nan")))
        return {"mean entropy": (self.entropy * rows).sum(-1) / n,
                "mean max weight": (self.max_weight * rows).sum(-1) / n,
                "first-token share": share}

    def uniform(self) -> dict[str, torch.Tensor]:
        """``{"first-token share", "mean max weight"}``, each (L,): what uniform attention over each row's
        readable keys would give, over the rows :meth:`grid` counts (an encoder on ``n`` real tokens: ``1 / n``
        each; a causal model: ``mean_{i >= 1} 1 / (i + 1)`` and ``mean_{i >= 0} 1 / (i + 1)``); NaN where no row
        is counted."""
        only, counted = self._rows()
        dtype = self.entropy.dtype
        n = self.reading.sum().clamp_min(1).to(dtype)
        keys = n.expand(self.n_layers, len(self.tokens)) if self.readable is None else self.readable.to(dtype)
        top = torch.where(keys > 0, 1 / keys.clamp_min(1), torch.zeros_like(keys))
        m, rows = counted.sum(-1).to(dtype), self.reading.sum().to(dtype)
        nan = torch.full((self.n_layers,), float("nan"), dtype=dtype)
        return {"first-token share": torch.where(m > 0, (self._uniform() * counted).sum(-1) / m.clamp_min(1), nan),
                "mean max weight": torch.where(rows > 0, (top * self.reading).sum(-1) / rows.clamp_min(1), nan)}

    def _first(self) -> int:
        # the first real token: under left padding column 0 is padding, which no real row reads
        return int(self.reading.nonzero()[0]) if self.reading.any() else 0

    def _uniform(self) -> torch.Tensor:
        """(L, s): the weight uniform attention over each row's readable keys puts on the first real token."""
        dtype = self.entropy.dtype
        rows = self.reading.to(dtype).expand(self.n_layers, -1)
        keys = rows * rows.sum(-1, keepdim=True) if self.readable is None else self.readable.to(dtype)
        first = rows > 0 if self.reads_first is None else self.reads_first & (rows > 0)
        return torch.where(first & (keys > 0), 1 / keys.clamp_min(1), torch.zeros_like(keys))

    def _rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows that may read only the first token, rows counted in the share): (L, s) bool each."""
        only = (self._uniform() == 1.0) & self.reading
        return only, self.reading & ~only

    def kinds(self) -> dict[str, list[tuple[int, int]]]:
        """``{"sink": [(layer, head), ...], "sharp": [...]}``: first-token share >= :data:`SINK_SHARE`; mean max
        weight >= :data:`SHARP_WEIGHT` (and not a sink); each also :data:`EXCESS` of the way from what uniform
        attention over each row's readable keys gives (:meth:`uniform`) to 1, so uniform attention is neither at
        any length; each sorted by that number, largest first."""
        g, u = self.grid(), self.uniform()
        share, top = g["first-token share"], g["mean max weight"]
        # (L,): the smallest number that is a sink (sharp); NaN (never) where uniform gives 1 or no row is counted
        floor = {k: (u[k] + EXCESS * (1 - u[k])).clamp_min(bound) for k, bound in
                 (("first-token share", SINK_SHARE), ("mean max weight", SHARP_WEIGHT))}
        floor = {k: torch.where(u[k] < 1, f, torch.full_like(f, float("nan"))) for k, f in floor.items()}
        pairs = self.pairs()
        sinks = sorted((p for p in pairs if share[p] >= floor["first-token share"][p[0]]),
                       key=lambda p: -float(share[p]))
        sharp = sorted((p for p in pairs if top[p] >= floor["mean max weight"][p[0]] and p not in sinks),
                       key=lambda p: -float(top[p]))
        return {"sink": sinks, "sharp": sharp}

    def chosen(self, count: int = 3) -> list[tuple[int, int]]:
        """Heads worth a per-position curve: the strongest sink, the sharpest head that is not a sink and the most
        spread head (distinct, at most ``count``; the largest of each number where no head is of that kind)."""
        g, kinds = self.grid(), self.kinds()
        out: list[tuple[int, int]] = []
        held = self.pairs()
        if not held:
            return out

        def best(values: torch.Tensor) -> tuple[int, int]:
            # among the heads held only: the cells of the others are NaN
            order = sorted(held, key=lambda p: -float(values[p]))
            return next((p for p in order if p not in out), order[0])

        for kind, values in (("sink", g["first-token share"]), ("sharp", g["mean max weight"]),
                             (None, g["mean entropy"])):
            pair = kinds[kind][0] if kind and kinds[kind] else best(values)
            if pair not in out:
                out.append(pair)
        return out[:count]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the grid, the kinds and the per-position arrays (rounded to 6 digits), each layer's list
        holding the heads it holds in the order of ``original_heads`` (their numbers: the kinds' pairs are
        [layer, number]); ``heads`` is the count of head numbers (h)."""
        held = [list(self.held(layer)) for layer in range(self.n_layers)]

        def rounded(t: torch.Tensor) -> Any:
            return [[[round(float(v), 6) for v in t[layer, head]] for head in heads]
                    for layer, heads in enumerate(held)]

        g = self.grid()
        return {"model": self.model, "tokens": self.tokens, "layers": self.n_layers, "heads": self.n_heads,
                "original_heads": held,
                "grid": {k: [[round(float(t[layer, head]), 6) for head in heads] for layer, heads in enumerate(held)]
                         for k, t in g.items()},
                "kinds": {k: [list(p) for p in v] for k, v in self.kinds().items()},
                "entropy": rounded(self.entropy), "max_weight": rounded(self.max_weight),
                "key_weight": rounded(self.key_weight)}


def model_statistics(model: torch.nn.Module, inputs: Any, *, tokens: list[str] | None = None, row: int = 0,
                     name: str = "") -> HeadStatistics:
    """Run ``model`` (a patched Hugging Face model, patched here if it is not yet, or a module of headwise layers)
    on ``inputs`` once in eval mode under a statistics trace, and keep batch row ``row``.

    Positions are labelled with ``tokens`` (default: their indices). A query position reads something unless
    the inputs' ``attention_mask`` ((b, s), 1 = a real token; any other shape is refused) marks it as padding.
    Self-attention over one sequence only: an encoder-decoder model (whatever its two lengths) or cross-attention
    to another sequence's states is refused (``model.get_encoder()`` gives an encoder's heads).

    Shapes:
        inputs: batch b on dim 0, s tokens -> HeadStatistics with (L, h, s) arrays

    Example:
        >>> import headwise
        >>> layers = torch.nn.Sequential(headwise.MultiHeadAttention(16, 4), headwise.MultiHeadAttention(16, 4))
        >>> st = model_statistics(layers, torch.randn(1, 5, 16))
        >>> st.entropy.shape, sorted(st.grid())
        (torch.Size([2, 4, 5]), ['first-token share', 'mean entropy', 'mean max weight'])
    """
    from ..statistics import STATISTICS
    from ..tracing import trace
    from ..tracing.inputs import batch_size, call, eval_mode, tensors_of
    from .maps import patched_for_the_call

    b = batch_size(inputs, "model_statistics")
    empty = [tuple(x.shape) for x in tensors_of(inputs) if isinstance(x, torch.Tensor) and x.dim() > 1 and x.shape[1] == 0]
    if empty:  # refused here: the model would fail deep inside on a sequence of no position
        raise ValueError(f"model_statistics: the inputs have 0 tokens (tensor of shape {empty[0]}); give at least "
                         "one position")
    if isinstance(row, bool) or not isinstance(row, int) or not -b <= row < b:
        raise ValueError(f"row must be an int in [-{b}, {b}) for this batch of {b}, got {row!r}")
    mask = _mask_of(inputs, b)
    # a Hugging Face model is patched first, and unpatched again when the call fails: every refusal below is
    # made inside the block, so a refused call leaves the model as it was
    with patched_for_the_call(model) as found:
        seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad(), eval_mode(model), padding_reads_nothing([layer for _, layer in found], mask), \
                counting_readable([layer for _, layer in found], row, mask, seen), trace(model, capture=STATISTICS) as t:
            # An encoder-decoder's decoder layers are known before the call: refused without running the model. A
            # stack run alone is marked whole (the trace takes it for its own decoder): its queries are its own
            # tokens, and a decoder stack's cross-attention is refused once the call shows it.
            decoder = [r.decoder for r in t]
            if any(decoder) and not all(decoder):
                raise ValueError(_ENCODER_DECODER)
            call(model, inputs)
            records = [r for r in t if r.calls]
            numbers = [_numbers(r.layer, i) for i, r in enumerate(records)]
        stats = _gathered(records, numbers, row, mask, tokens, name)
        counted = [seen.get(id(r.layer)) for r in records]
        if all(c is not None and c[0].shape == (len(stats.tokens),) for c in counted):
            stats.readable = torch.stack([c[0] for c in counted])  # type: ignore[index]
            stats.reads_first = torch.stack([c[1] for c in counted])  # type: ignore[index]
        return stats


_ENCODER_DECODER = (
    "model_statistics draws self-attention over one sequence, and this model attends across two (an "
    "encoder-decoder's decoder, or cross-attention to another sequence's states); for an encoder-decoder's "
    "encoder heads give it the encoder alone: model_statistics(model.get_encoder(), {'input_ids': ..., "
    "'attention_mask': ...})")


def _mask_of(inputs: Any, b: int) -> torch.Tensor | None:
    """The inputs' ``attention_mask`` (None: none given), or the error that refuses it: it marks the real tokens
    of each input row, so it must be (b, s) for inputs of b rows of s tokens (s checked here where the inputs
    show it, as ``input_ids`` or ``inputs_embeds``; else against the layers' positions after the call)."""
    mask = inputs.get("attention_mask") if hasattr(inputs, "get") else None
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"model_statistics: attention_mask must be a (batch, positions) tensor, 1 = a real token; "
                        f"got {type(mask).__name__}")
    given = next((x for x in (inputs.get("input_ids"), inputs.get("inputs_embeds"))
                  if isinstance(x, torch.Tensor) and x.dim() >= 2), None)
    s = given.shape[1] if given is not None else None
    if mask.dim() != 2 or mask.shape[0] != b or (s is not None and mask.shape[1] != s):
        expected = f"({b}, {s})" if s is not None else f"({b}, positions)"
        raise ValueError(f"model_statistics: attention_mask must be (batch, positions) = {expected}, one 1 or 0 per "
                         f"input token, got shape {tuple(mask.shape)}")
    return mask


def _gathered(records: list, numbers: list[tuple[int, ...]], row: int, mask: Any, tokens: Any,
              name: str) -> HeadStatistics:
    """The HeadStatistics of batch row ``row`` from the trace's records (each layer's head numbers
    ``numbers``), or the ValueError that refuses them."""
    from .numbers import plural

    if not records:
        raise ValueError("model_statistics: no attention layer of the model ran on these inputs")
    # Asked before any shape: a layer's several calls join along the queries, so their shapes mislead.
    for r in records:
        r.require_one_call("model_statistics", "calls[j]['entropy']")
    # by what each call read, not by shape: a cross-attention's keys may be as many as its queries
    if any(r.cross for r in records):
        raise ValueError(_ENCODER_DECODER)
    h = max((max(n) + 1 for n in numbers if n), default=0)
    s = records[0].entropy.shape[-1]
    if s == 0:
        raise ValueError("model_statistics: the inputs have 0 tokens; give at least one position")
    if any(r.entropy.shape[-1] != s or r.key_weight.shape[-1] != s for r in records):
        raise ValueError("model_statistics draws self-attention: every layer's queries and keys must be the "
                         "same positions")
    if mask is not None and mask.shape[1] != s:
        raise ValueError(f"model_statistics: attention_mask has shape {tuple(mask.shape)}, expected (batch, "
                         f"positions) = ({mask.shape[0]}, {s}): the layers attended over {plural(s, 'position')}")
    labels = [str(x) for x in tokens] if tokens is not None else [str(i) for i in range(s)]
    if len(labels) != s:
        raise ValueError(f"got {plural(len(labels), 'token')} for a sequence of {plural(s, 'position')}")

    def stack(name: str) -> torch.Tensor:
        out = torch.full((len(records), h, s), float("nan"))  # (L, h, s): NaN where a layer has no such head
        for i, (r, heads) in enumerate(zip(records, numbers)):
            if heads:  # () after every head was removed: the placeholder row is no head of the model
                out[i, list(heads)] = getattr(r, name)[row, :len(heads)].float().cpu()
        return out

    reading = torch.ones(s, dtype=torch.bool) if mask is None else mask[row].bool().cpu()
    uniform = all(n == tuple(range(h)) for n in numbers)
    return HeadStatistics(labels, stack("entropy"), stack("max_weight"), stack("key_weight"), reading, name,
                          None if uniform else tuple(numbers))


def _numbers(layer: Any, index: int) -> tuple[int, ...]:
    """The number each head of ``layer`` is shown under: its index before head surgery (``()``: every head was
    removed), as the pattern drawings number it."""
    from ..surgery import origin

    heads = origin.of_layer(layer)
    if len(set(heads)) != len(heads) or (heads and len(heads) != layer.n_heads):
        raise ValueError(f"model_statistics: layer {index}'s head surgery record {heads!r} does not give one "
                         f"distinct number to each of its {layer.n_heads} heads")
    return heads
