"""Every head of a model at long context, from per-head statistics (no pattern): :class:`HeadStatistics`.

:func:`model_statistics` runs a model once under ``headwise.trace(model, capture=("lse", "entropy",
"max_weight", "key_weight"))`` (:mod:`headwise.statistics`: never more than a bounded chunk of any head's
pattern in memory) and keeps, for one batch row, every layer x head's

* entropy and max weight of each query position (natural log; a sink's share is on no key),
* key weight of each key position (its weight summed over every query),

from which :meth:`HeadStatistics.grid` gives the three numbers per head drawn as a grid: the mean entropy, the
mean max weight (both over the rows that read something) and the first-token share (the weight on the first
real position, the first the ``attention_mask`` marks as a token, divided by the number of rows that read
something: a "sink" head puts most of its weight there). Under right padding an encoder's padded rows read the
real keys too and their weight counts in ``key_weight``, so there the share can exceed 1. :meth:`HeadStatistics.kinds`
names the sink heads and the sharp ones.

Shapes:
    L: layers, h: heads (the fewest of any layer), s: positions (queries and keys: self-attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HeadStatistics", "model_statistics", "SINK_SHARE", "SHARP_WEIGHT"]

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
        key_weight: (L, h, s) per key position, summed over the query positions.
        reading: (s,) bool: query positions that read something (not padding).
        model: the model's name, for titles.

    Shapes:
        entropy, max_weight, key_weight: (L, h, s); reading: (s,)
    """

    tokens: list[str]
    entropy: torch.Tensor
    max_weight: torch.Tensor
    key_weight: torch.Tensor
    reading: torch.Tensor
    model: str = ""

    @property
    def n_layers(self) -> int:
        return self.entropy.shape[0]

    @property
    def n_heads(self) -> int:
        return self.entropy.shape[1]

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
        pairs = [(layer, head) for layer in range(self.n_layers) for head in range(self.n_heads)]
        sinks = sorted((p for p in pairs if share[p] >= SINK_SHARE), key=lambda p: -float(share[p]))
        sharp = sorted((p for p in pairs if top[p] >= SHARP_WEIGHT and p not in sinks), key=lambda p: -float(top[p]))
        return {"sink": sinks, "sharp": sharp}

    def chosen(self, count: int = 3) -> list[tuple[int, int]]:
        """Heads worth a per-position curve: the strongest sink, the sharpest head that is not a sink and the most
        spread head (distinct, at most ``count``; the largest of each number where no head is of that kind)."""
        g, kinds = self.grid(), self.kinds()
        out: list[tuple[int, int]] = []

        def best(values: torch.Tensor) -> tuple[int, int]:
            order = values.flatten().argsort(descending=True).tolist()
            free = [i for i in order if (i // self.n_heads, i % self.n_heads) not in out] or order
            return free[0] // self.n_heads, free[0] % self.n_heads

        for kind, values in (("sink", g["first-token share"]), ("sharp", g["mean max weight"]),
                             (None, g["mean entropy"])):
            pair = kinds[kind][0] if kind and kinds[kind] else best(values)
            if pair not in out:
                out.append(pair)
        return out[:count]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the grid (L x h lists), the kinds and the per-position arrays (rounded to 6 digits)."""
        def rounded(t: torch.Tensor) -> Any:
            return [[[round(float(v), 6) for v in row] for row in layer] for layer in t]

        g = self.grid()
        return {"model": self.model, "tokens": self.tokens, "layers": self.n_layers, "heads": self.n_heads,
                "grid": {k: [[round(float(v), 6) for v in row] for row in t] for k, t in g.items()},
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
    from .numbers import plural

    b = batch_size(inputs, "model_statistics")
    empty = [tuple(x.shape) for x in tensors_of(inputs) if isinstance(x, torch.Tensor) and x.dim() > 1 and x.shape[1] == 0]
    if empty:  # refused here: the model would fail deep inside on a sequence of no position
        raise ValueError(f"model_statistics: the inputs have 0 tokens (tensor of shape {empty[0]}); give at least "
                         "one position")
    if isinstance(row, bool) or not isinstance(row, int) or not -b <= row < b:
        raise ValueError(f"row must be an int in [-{b}, {b}) for this batch of {b}, got {row!r}")
    # a Hugging Face model is patched first, and unpatched again when the call fails
    with patched_for_the_call(model), torch.no_grad(), eval_mode(model), trace(model, capture=STATISTICS) as t:
        call(model, inputs)
    records = [r for r in t if r.calls]
    if not records:
        raise ValueError("model_statistics: no attention layer of the model ran on these inputs")
    h = min(r.entropy.shape[1] for r in records)  # layers may differ after head surgery
    s = records[0].entropy.shape[-1]
    if s == 0:
        raise ValueError("model_statistics: the inputs have 0 tokens; give at least one position")
    if any(r.entropy.shape[-1] != s or r.key_weight.shape[-1] != s for r in records):
        raise ValueError("model_statistics draws self-attention: every layer's queries and keys must be the "
                         "same positions")

    def stack(name: str) -> torch.Tensor:
        return torch.stack([getattr(r, name)[row, :h].float().cpu() for r in records])  # (L, h, s)

    mask = inputs.get("attention_mask") if hasattr(inputs, "get") else None
    reading = torch.ones(s, dtype=torch.bool) if mask is None else mask[row].bool().cpu()
    labels = [str(x) for x in tokens] if tokens is not None else [str(i) for i in range(s)]
    if len(labels) != s:
        raise ValueError(f"got {plural(len(labels), 'token')} for a sequence of {plural(s, 'position')}")
    return HeadStatistics(labels, stack("entropy"), stack("max_weight"), stack("key_weight"), reading, name)
