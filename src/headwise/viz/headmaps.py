"""The numbers of one picture: :class:`HeadMaps`, the per-head reads and writes of one layer (or of chosen
(layer, head) pairs) on one sequence, with what each head does by position and its table row.

Shapes:
    s: tokens, h: heads (rows). weights, writes: (h, s_q, s_kv); value_norms: (h, s_kv).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from .numbers import span
from .positions import POSITIONS, positional_scores

__all__ = ["HeadMaps", "default_title", "check_values", "no_heads", "short_label", "LABEL_CHARS"]

LABEL_CHARS = 12  # an axis label's most characters, in the PNG and on the page: a long token would run off


@dataclass(frozen=True)
class HeadMaps:
    """Per-head reads and writes of one layer for one sequence, or of chosen (layer, head) pairs (a gallery,
    :func:`head_gallery`: ``layers`` gives each row's layer).

    Where the layer's W_O is not located (:attr:`writes_missing` says why), only the weights are known:
    ``writes`` and ``value_norms`` are None. After head surgery ``original_heads`` gives each row's index in
    the model before surgery (:func:`headwise.surgery.original_heads`), which the pictures and tables show.

    Shapes:
        weights: (h, s, s) rows sum to 1; writes: (h, s, s) = weights * value_norms[:, None, :];
        value_norms: (h, s) = ||v_j W_O^h||
    """

    tokens: list[str]
    layer: int
    weights: torch.Tensor
    writes: torch.Tensor | None
    value_norms: torch.Tensor | None
    heads: tuple[int, ...] | None = None  # the layer's head index of each row (None: 0 .. h - 1)
    writes_missing: str = ""  # why writes and value_norms are None ("" when they are known)
    original_heads: tuple[int, ...] | None = None  # each row's index before head surgery (None: unchanged)
    layers: tuple[int, ...] | None = None  # a gallery: the layer of each row (None: every row is of ``layer``)
    real: torch.Tensor | None = None  # (s,) bool: which positions hold text, not padding (None: all)

    def __post_init__(self) -> None:
        # Checked once, here: every picture, page and table indexes these arrays by the tokens, and a mismatch
        # would draw something else (or fail deep in torch) rather than say what is wrong.
        if not isinstance(self.tokens, list) or not all(isinstance(t, str) for t in self.tokens):
            raise TypeError(f"tokens must be a list of str, got {type(self.tokens).__name__} {self.tokens!r:.80}")
        if isinstance(self.layer, bool) or not isinstance(self.layer, int):
            raise TypeError(f"layer must be an int, got {type(self.layer).__name__} {self.layer!r}")
        s = len(self.tokens)
        arrays = {"weights": self.weights, "writes": self.writes, "value_norms": self.value_norms, "real": self.real}
        for name, t in arrays.items():
            if not (t is None and name != "weights") and not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor{'' if name == 'weights' else ' or None'}, got "
                                f"{type(t).__name__}")
        w = tuple(self.weights.shape)
        if len(w) != 3 or w[1:] != (s, s):
            raise ValueError(f"weights must be (h, s, s) = (h, {s}, {s}) for {s} tokens, got {_shape(w)}")
        h = w[0]
        want = {"writes": ("(h, s, s)", (h, s, s)), "value_norms": ("(h, s)", (h, s)), "real": ("(s,)", (s,))}
        for name, (form, shape) in want.items():
            t = arrays[name]
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{name} must be {form} = {_shape(shape)} for {s} tokens and the weights' {h} "
                                 f"heads, got {_shape(tuple(t.shape))}")
        for name in ("heads", "original_heads", "layers"):
            got = getattr(self, name)
            if got is not None and len(got) != h:
                raise ValueError(f"{name} must give one number per head (the weights' {h}), got {len(got)}: {got!r}")

    def __repr__(self) -> str:
        # one line, as the other main objects print: the dataclass default would print every tensor
        where = f"layer={self.layer}" if self.layers is None else f"layers=[{span(sorted(set(self.layers)))}]"
        writes = "None (W_O not located)" if self.writes is None else tuple(self.writes.shape)
        return (f"HeadMaps({where}, heads=[{span(self.head_labels)}], {len(self.tokens)} tokens, "
                f"weights {tuple(self.weights.shape)}, writes {writes})")

    @property
    def n_heads(self) -> int:
        return self.weights.shape[0]

    @property
    def head_ids(self) -> list[int]:
        """The layer's index of each head held now (all heads unless a subset was chosen)."""
        return list(range(self.n_heads)) if self.heads is None else list(self.heads)

    @property
    def head_labels(self) -> list[int]:
        """The number each head is shown under: its original index where surgery changed the layer, else its
        index now."""
        return self.head_ids if self.original_heads is None else list(self.original_heads)

    @property
    def layer_ids(self) -> list[int]:
        """The layer of each row."""
        return [self.layer] * self.n_heads if self.layers is None else list(self.layers)

    @property
    def names(self) -> list[str]:
        """``L{layer} H{head}`` of each row (original head numbers)."""
        return [f"L{layer} H{head}" for layer, head in zip(self.layer_ids, self.head_labels)]

    def subset(self, rows: Sequence[int]) -> "HeadMaps":
        """These rows only (positions in this HeadMaps, in the order given)."""
        rows = list(rows)

        def pick(t: Any) -> Any:
            return None if t is None else t[rows]

        return replace(self, weights=self.weights[rows], writes=pick(self.writes), value_norms=pick(self.value_norms),
                       heads=tuple(self.head_ids[r] for r in rows),
                       original_heads=None if self.original_heads is None else tuple(self.original_heads[r]
                                                                                     for r in rows),
                       layers=None if self.layers is None else tuple(self.layers[r] for r in rows))

    def summary(self) -> list[dict[str, Any]]:
        """Per head: what it does by position (mean weight on the previous / same / next / first token and on
        separators, :mod:`headwise.viz.positions`, and the largest of them), the token it reads most from (mean
        weight over queries) and the token it writes most from (share of the head's total writes), and the
        range of its value norms (those None without writes). Padding (``real`` False) is neither a query nor a
        key here, so a padded batch row summarises as the same text alone; indices stay those of the drawn row.

        Shapes:
            reads: weights[h].mean(0) over real queries and keys, (s_kv,); writes: writes[h].sum(0) / total
        """
        out = []
        positions = positional_scores(self.weights, self.tokens, self.real)
        # padding is neither a query nor a key here: a padded row summarises as the same text alone
        keep = torch.arange(len(self.tokens)) if self.real is None else self.real.cpu().nonzero()[:, 0]
        for h in range(self.n_heads):
            reads = self.weights[h][keep][:, keep].mean(0)  # (s_real,)
            r = int(keep[int(reads.argmax())])
            reads_r = float(reads.max())
            by_position = {name: float(positions[name][h]) for name in POSITIONS}
            known = {k: v for k, v in by_position.items() if v == v}  # NaN: no query to score
            top = max(known, key=known.get) if known else None
            row = {"layer": self.layer_ids[h], "head": self.head_labels[h], "index": self.head_ids[h],
                   **by_position, "positional": top, "positional_weight": known.get(top),
                   "reads_most": self.tokens[r], "reads_most_index": r, "reads_most_weight": reads_r}
            if self.writes is None or self.value_norms is None:
                row.update(dict.fromkeys(("writes_most", "writes_most_index", "writes_most_share",
                                          "weight_on_reads_most_share_of_writes", "value_norm_min",
                                          "value_norm_max")))
            else:
                writes = torch.zeros_like(self.value_norms[h])  # (s,), padding's share left at 0
                writes[keep] = self.writes[h][keep][:, keep].sum(0)
                share = writes / writes.sum().clamp_min(1e-30)
                w = int(share.argmax())
                norms = self.value_norms[h][keep]
                row.update({"writes_most": self.tokens[w], "writes_most_index": w,
                            "writes_most_share": float(share[w]),
                            "weight_on_reads_most_share_of_writes": float(share[r]),
                            "value_norm_min": float(norms.min()), "value_norm_max": float(norms.max())})
            out.append(row)
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain lists, for JSON (float32 precision, rounded to 6 significant digits); writes and value norms
        are null, and ``writes_missing`` says why, where W_O is not located. ``heads`` are the layer's indices
        now, ``original_heads`` the numbers before head surgery, ``layers`` each row's layer."""
        def r(t: torch.Tensor | None) -> list | None:
            if t is None:
                return None
            return [[float(f"{v:.6g}") for v in row] for row in t.tolist()] if t.dim() == 2 else [r(x) for x in t]

        return {"tokens": list(self.tokens), "layer": self.layer, "n_heads": self.n_heads, "heads": self.head_ids,
                "original_heads": self.head_labels, "layers": self.layer_ids,
                "weights": r(self.weights), "writes": r(self.writes), "value_norms": r(self.value_norms),
                "writes_missing": self.writes_missing}


def default_title(many: list[HeadMaps]) -> str:
    """What the maps show, as the picture's title: ``Layer 2``, ``Heads L0 H2, L1 H8`` (a gallery), or
    ``Layers 0-5 x heads 0-11`` (the heads' original numbers after head surgery)."""
    if len(many) == 1:
        m = many[0]
        return f"Heads {', '.join(m.names)}" if m.layers is not None else f"Layer {m.layer}"
    labels = {tuple(m.head_labels) for m in many}
    heads = f"heads {span(many[0].head_labels)}" if len(labels) == 1 else "heads (per layer)"
    return f"Layers {span([m.layer for m in many])} x {heads}"


def _shape(shape: tuple) -> str:
    return f"({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''})"


def short_label(token: str) -> str:
    """``token`` as an axis label: at most :data:`LABEL_CHARS` characters, a cut one ending in an ellipsis (the
    page's labels are these too; hovering a cell there shows the whole token).

    Example:
        >>> short_label("a" * 20), short_label("cat")
        ('aaaaaaaaaaa…', 'cat')
    """
    return token if len(token) <= LABEL_CHARS else token[:LABEL_CHARS - 1] + "\u2026"


def no_heads(m: HeadMaps) -> str:
    """Why ``m`` (a HeadMaps of no head) has nothing to draw."""
    return (f"layer {m.layer} has no head to draw: head surgery removed every head of it (the placeholder head it "
            "keeps is not drawn)")


def check_values(many: Sequence[HeadMaps]) -> None:
    """ValueError unless every weight is finite and in [0, 1] and every value norm finite and >= 0: a picture of
    NaN or of weights that are no probabilities would show something the model never computed (and a page could
    not hold NaN in its JSON)."""
    for m in many:
        w = m.weights.detach()
        if w.numel() and (not bool(torch.isfinite(w).all()) or float(w.min()) < 0 or float(w.max()) > 1 + 1e-5):
            raise ValueError("attention weights must be finite and in [0, 1] to be drawn")
        n = m.value_norms
        if n is not None and n.numel() and (not bool(torch.isfinite(n).all()) or float(n.min()) < 0):
            bad = [m.head_labels[i] for i in range(n.shape[0])
                   if not bool(torch.isfinite(n[i]).all() and (n[i] >= 0).all())]
            raise ValueError(f"value norms ||v_j W_O^h|| must be finite and >= 0 to be drawn; layer {m.layer} head(s) "
                             f"{bad} are not (a NaN or inf in the model's W_O or values)")
