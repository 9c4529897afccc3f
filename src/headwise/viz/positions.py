"""What a head does by position, from its attention weights: how much weight each query puts on the previous
token, itself, the next token, the first token and the separators. The commonest head types (previous-token
heads, [CLS] / first-token sinks, separator heads) read off these five numbers where the mean weight per key
token hides them (a 0.91 previous-token head spreads its weight over every token, so no single key stands out).

Every score is a mean over the queries after the first (query 0 has no previous token, and a causal model's
query 0 can only read itself), each query's weight on the key(s) in question:

* ``previous``: key i - 1; ``same``: key i; ``next``: key i + 1 (queries 1 .. s - 2; 0 in a causal model);
* ``first``: key 0 (the [CLS] / BOS token, where many heads park their weight);
* ``separators``: the summed weight on separator tokens after position 0: special tokens such as ``[SEP]``,
  ``</s>``, ``<|endoftext|>`` (padding excluded) and tokens made only of punctuation (``.``, ``,``, ``Ġ.``).

Given which positions are real (``real``, from the attention mask), padding is dropped first: neither a query nor
a key, so "first" is the first real token and a padded row scores as the same text alone.

Shapes:
    weights: (h, s, s), rows = queries -> five (h,) tensors
"""

from __future__ import annotations

import re
import unicodedata

import torch

__all__ = ["POSITIONS", "positional_scores", "is_separator"]

POSITIONS = ("previous", "same", "next", "first", "separators")
# Word-piece markers tokenizers put on a token (BERT's "##", GPT-2's "Ġ"/"Ċ", SentencePiece's "▁").
_MARKERS = re.compile(r"^(##|Ġ|Ċ|▁)+")
_SPECIAL = re.compile(r"^(\[[A-Za-z_]+\]|<\|?/?[A-Za-z_]+\|?>)$")
_PADDING = {"[pad]", "<pad>", "<|pad|>", "<|padding|>"}


def is_separator(token: str) -> bool:
    """Whether ``token`` separates text: a special token in brackets (``[SEP]``, ``</s>``, ``<|endoftext|>``;
    padding excluded) or a token made only of punctuation once its word-piece marker is removed.

    Example:
        >>> [is_separator(t) for t in ("[SEP]", "</s>", "[PAD]", ".", "Ġ,", "##s", "cat")]
        [True, True, False, True, True, False, False]
    """
    if _SPECIAL.match(token):
        return token.lower() not in _PADDING
    text = _MARKERS.sub("", token).strip()
    return bool(text) and all(unicodedata.category(c).startswith("P") for c in text)


def positional_scores(weights: torch.Tensor, tokens: list[str],
                      real: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Each head's mean weight on the previous / same / next / first token and on separators (module doc).

    Args:
        weights: the heads' attention weights, queries on dim 1.
        tokens: the label of each position.
        real: which positions hold text (False: padding), or None for all: padding is neither a query nor a key
            here, so a padded row scores as the same text alone ("first" is its first real token).

    Shapes:
        weights: (h, s, s), real: (s,) bool -> {name: (h,) float64}, NaN where a score has no query (fewer than 2
        real positions; next: 3)

    Example:
        >>> w = torch.zeros(1, 4, 4); w[0, 0, 0] = 1
        >>> w[0, torch.arange(1, 4), torch.arange(3)] = 1      # a previous-token head
        >>> {k: round(float(v[0]), 2) for k, v in positional_scores(w, list("abcd")).items()}
        {'previous': 1.0, 'same': 0.0, 'next': 0.0, 'first': 0.33, 'separators': 0.0}
    """
    w = weights.detach().double()
    if real is not None:
        keep = real.to(device=w.device, dtype=torch.bool)
        w, tokens = w[:, keep][:, :, keep], [t for t, k in zip(tokens, keep.tolist()) if k]
    h, s = w.shape[0], w.shape[-1]
    nan = torch.full((h,), float("nan"), dtype=torch.float64)
    if s < 2:
        return {name: nan.clone() for name in POSITIONS}
    q = torch.arange(1, s)
    seps = torch.tensor([is_separator(t) and j > 0 for j, t in enumerate(tokens)], dtype=torch.bool)
    inner = torch.arange(1, s - 1)
    return {
        "previous": w[:, q, q - 1].mean(-1),
        "same": w[:, q, q].mean(-1),
        "next": w[:, inner, inner + 1].mean(-1) if s > 2 else nan.clone(),
        "first": w[:, q, 0].mean(-1),
        "separators": w[:, q][:, :, seps].sum(-1).mean(-1),
    }
