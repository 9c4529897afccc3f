"""Every head of a model at long context, from per-head statistics (no pattern): :class:`HeadStatistics`.

:func:`model_statistics` runs a model once under ``headwise.trace(model, capture=("lse", "entropy",
"max_weight", "key_weight"))`` (:mod:`headwise.statistics`: never more than a bounded chunk of any head's
pattern in memory) and keeps, for one batch row, every layer x head's

* entropy and max weight of each query position (natural log; a sink's share is on no key),
* key weight of each key position (its weight summed over every query that reads something),

from which :meth:`HeadStatistics.grid` gives the three numbers per head drawn as a grid: the mean entropy, the
mean max weight (both over the rows that read something) and the first-token share (the weight on the first
real position, the first the ``attention_mask`` marks as a token, divided by the number of rows that read
something: a "sink" head puts most of its weight there). A padding query row (``attention_mask`` 0) reads
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

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

__all__ = ["HeadStatistics", "model_statistics", "padding_reads_nothing", "SINK_SHARE", "SHARP_WEIGHT"]

#: A head is a sink head when its first-token share is at least this.
SINK_SHARE = 0.5
#: A head is sharp when its mean max weight is at least this (and it is not a sink head).
SHARP_WEIGHT = 0.5


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

    Shapes:
        entropy, max_weight, key_weight: (L, h, s); reading: (s,)
    """

    tokens: list[str]
    entropy: torch.Tensor
    max_weight: torch.Tensor
    key_weight: torch.Tensor
    reading: torch.Tensor
    model: str = ""
    heads: tuple[tuple[int, ...], ...] | None = None

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
        """``ValueError`` naming the first of ``pairs`` that is not a (layer, head) these statistics hold."""
        for pair in pairs:
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
        # the first real token: under left padding column 0 is padding, which no real row reads
        first = int(self.reading.nonzero()[0]) if self.reading.any() else 0
        return {"mean entropy": (self.entropy * rows).sum(-1) / n,
                "mean max weight": (self.max_weight * rows).sum(-1) / n,
                "first-token share": self.key_weight[..., first] / n}

    def kinds(self) -> dict[str, list[tuple[int, int]]]:
        """``{"sink": [(layer, head), ...], "sharp": [...]}``: first-token share >= :data:`SINK_SHARE`; mean max
        weight >= :data:`SHARP_WEIGHT` (and not a sink), each sorted by that number, largest first."""
        g = self.grid()
        share, top = g["first-token share"], g["mean max weight"]
        pairs = self.pairs()
        sinks = sorted((p for p in pairs if share[p] >= SINK_SHARE), key=lambda p: -float(share[p]))
        sharp = sorted((p for p in pairs if top[p] >= SHARP_WEIGHT and p not in sinks), key=lambda p: -float(top[p]))
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
    the inputs' ``attention_mask`` marks it as padding.

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
    mask = inputs.get("attention_mask") if hasattr(inputs, "get") else None
    # a Hugging Face model is patched first, and unpatched again when the call fails: every refusal below is
    # made inside the block, so a refused call leaves the model as it was
    with patched_for_the_call(model) as found:
        with torch.no_grad(), eval_mode(model), padding_reads_nothing([layer for _, layer in found], mask), \
                trace(model, capture=STATISTICS) as t:
            call(model, inputs)
            records = [r for r in t if r.calls]
            numbers = [_numbers(r.layer, i) for i, r in enumerate(records)]
        return _gathered(records, numbers, row, mask, tokens, name)


def _gathered(records: list, numbers: list[tuple[int, ...]], row: int, mask: Any, tokens: Any,
              name: str) -> HeadStatistics:
    """The HeadStatistics of batch row ``row`` from the trace's records (each layer's head numbers
    ``numbers``), or the ValueError that refuses them."""
    from .numbers import plural

    if not records:
        raise ValueError("model_statistics: no attention layer of the model ran on these inputs")
    h = max((max(n) + 1 for n in numbers if n), default=0)
    s = records[0].entropy.shape[-1]
    if s == 0:
        raise ValueError("model_statistics: the inputs have 0 tokens; give at least one position")
    if any(r.entropy.shape[-1] != s or r.key_weight.shape[-1] != s for r in records):
        raise ValueError("model_statistics draws self-attention: every layer's queries and keys must be the "
                         "same positions")
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


@contextlib.contextmanager
def padding_reads_nothing(layers: list, attention_mask: Any) -> Iterator[None]:
    """For the block, every padding query row (``attention_mask`` 0) of ``layers`` reads no key, so that it adds
    nothing to ``key_weight``: eager's additive mask (finfo.min, not -inf) lets a row masked off everywhere read
    every key evenly, and an encoder's padding rows read the real keys. No real row's numbers change: no real row
    reads a padding key, so nothing a padding row computes reaches one. Calls whose queries are not the
    mask's positions (a decode step, cross-attention) and calls without a mask are left as they are.

    Shapes:
        attention_mask: (b, s), 1 = a real token
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or bool(attention_mask.bool().all()):
        yield
        return
    real = attention_mask.bool()

    def wrapped(attend: Any) -> Any:
        def attend_real_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Any = None,
                             **kwargs: Any) -> Any:
            # a call handed a plan was planned on its mask (MultiHeadAttention.forward): left as it is
            if isinstance(mask, torch.Tensor) and kwargs.get("plan") is None and (q.shape[0], q.shape[2]) == real.shape:
                rows = real.to(mask.device)[:, None, :, None]  # (b, 1, s_q, 1)
                mask = mask & rows if mask.dtype == torch.bool else torch.where(rows, mask, float("-inf"))
            return attend(q, k, v, mask=mask, **kwargs)

        return attend_real_rows

    unique = list({id(layer): layer for layer in layers}.values())  # a layer shared by two places: wrapped once
    saved = [(layer, layer.__dict__.get("attend")) for layer in unique]
    try:
        for layer, _ in saved:
            layer.__dict__["attend"] = wrapped(layer.attend)  # this instance only, for the block
        yield
    finally:
        for layer, before in saved:
            if before is None:
                layer.__dict__.pop("attend", None)
            else:
                layer.__dict__["attend"] = before
