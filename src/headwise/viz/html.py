"""A self-contained HTML page of the heads: every layer x head as a thumbnail (the model view) that opens
into a head view with axis labels and a tooltip giving the tokens and values under the pointer.

Data, CSS and JavaScript are inline; a Content-Security-Policy forbids any network access; tokens reach the
page only as escaped JSON and are drawn with ``textContent`` / ``fillText`` (never parsed as markup).

**Encoding** (why it stays small): the weights are quantised to uint8 (step 1/255, so a value shown is
within 1/510 of the traced one), laid out (layer, head, query, key), followed by the value norms
``||v_j W_O^h||`` as float32; the writes are not stored, the page computes them as weight x norm. The
bytes are gzip-compressed and base64-encoded; the browser decodes them with its own ``DecompressionStream``.
Attention is sparse and the zeros (weights below 1/510) come in long runs, which gzip stores in a few bits
each, so no explicit sparse format is needed: at 512 tokens x 6 layers x 12 heads of all-MiniLM-L6-v2
(18.9M weights, 18.9 MB as plain uint8) the page is a few MB, and drawing happens on ``<canvas>``
(one pixel per cell, no DOM node per cell).

Shapes:
    L: rows of thumbnails (layers, or one row of a gallery's pairs), h: heads per row, s: tokens. Stored: weights
    (L, h, s, s) uint8, norms (L, h, s) float32; ``cells[l][h]`` is (layer, head number) of each thumbnail.
"""

from __future__ import annotations

import base64
import gzip
import html
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from .files import check_text, write_atomically
from .html_page import PAGE
from .headmaps import HeadMaps, check_values, default_title, no_heads, short_label

__all__ = ["render_html", "save_html", "encode", "decode", "QUANT_STEPS"]

QUANT_STEPS = 255  # a weight w is stored as round(w * 255)


def _as_list(maps: HeadMaps | Sequence[HeadMaps]) -> list[HeadMaps]:
    many = [maps] if isinstance(maps, HeadMaps) else list(maps)
    if not many or not all(isinstance(m, HeadMaps) for m in many):
        raise TypeError(f"maps must be a HeadMaps or a non-empty sequence of HeadMaps, got {type(maps).__name__}")
    first = many[0]
    empty = next((m for m in many if not m.n_heads), None)
    if empty is not None:
        raise ValueError(no_heads(empty))
    if any(m.tokens != first.tokens or m.n_heads != first.n_heads for m in many):
        raise ValueError("every HeadMaps of one page must have the same tokens and the same number of heads")
    if len(many) > 1 and any(m.layers is not None for m in many):
        raise ValueError("a gallery of (layer, head) pairs (head_gallery) is one HeadMaps: draw it on its own")
    check_values(many)  # a NaN norm would put NaN, which is not JSON, into the page: it would draw nothing
    return many


def _grid(many: list[HeadMaps]) -> dict[str, Any]:
    """The page's names: one row of thumbnails per HeadMaps (a gallery: one row of its pairs), each cell's
    (layer, head number), the row names and the column headers (heads by their original numbers)."""
    cells = [[[layer, head] for layer, head in zip(m.layer_ids, m.head_labels)] for m in many]
    if many[0].layers is not None:
        return {"cells": cells, "rows": ["chosen heads"], "cols": many[0].names}
    same = all(m.head_labels == many[0].head_labels for m in many)
    return {"cells": cells, "rows": [f"layer {m.layer}" for m in many],
            "cols": [f"head {h}" for h in many[0].head_labels] if same else [""] * many[0].n_heads}


def _bytes(t: torch.Tensor) -> bytes:
    """The raw little-endian bytes of ``t`` (no numpy needed)."""
    flat = t.contiguous().view(-1).view(torch.uint8)
    buf = bytearray(flat.numel())
    if buf:
        torch.frombuffer(buf, dtype=torch.uint8).copy_(flat)
    return bytes(buf)


def _little_endian(t: torch.Tensor) -> torch.Tensor:
    """float32 ``t`` as little-endian bytes (the page reads them with a little-endian Float32Array)."""
    raw = t.contiguous().view(torch.uint8).view(-1, 4)
    return raw.flip(1) if sys.byteorder == "big" else raw  # pragma: no branch


def encode(maps: HeadMaps | Sequence[HeadMaps]) -> tuple[dict[str, Any], str]:
    """(metadata, base64 of the gzip-compressed data) that the page embeds (see the module doc).

    Shapes:
        maps: L HeadMaps with (h, s, s) weights -> L * h * s * s bytes of weights + L * h * s float32 norms
    """
    many = _as_list(maps)
    w = torch.stack([m.weights.detach().float() for m in many])  # (L, h, s, s), checked by _as_list
    q = (w * QUANT_STEPS).round_().clamp_(0, QUANT_STEPS).to(torch.uint8)
    # Where W_O is not located the norms are unknown: zeros keep the blob's layout, and "writes_missing" tells the
    # page to draw the reads alone.
    norms = torch.stack([torch.zeros(m.weights.shape[0], m.weights.shape[-1]) if m.value_norms is None
                         else m.value_norms.detach().float() for m in many])  # (L, h, s)
    max_write = max(float((q[i].float() / QUANT_STEPS * norms[i][:, None, :]).max()) for i in range(len(many)))
    raw = _bytes(q) + _bytes(_little_endian(norms))
    blob = base64.b64encode(gzip.compress(raw, compresslevel=6, mtime=0)).decode("ascii")
    meta = {"tokens": list(many[0].tokens), "labels": [short_label(t) for t in many[0].tokens], "layers": [m.layer for m in many], "heads": many[0].head_labels,
            **_grid(many),
            "s": len(many[0].tokens), "steps": QUANT_STEPS, "max_write": max_write or 1.0,
            "encoding": "gzip+base64: uint8 weights (layer, head, query, key), then float32 norms (layer, head, key)",
            "writes_missing": next((m.writes_missing for m in many if m.value_norms is None), "")}
    return meta, blob


def decode(meta: dict[str, Any], blob: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`encode` (what the page's JavaScript does): (weights, norms) as float32.

    Shapes:
        -> weights (L, h, s, s) multiples of 1/255, norms (L, h, s)

    Example:
        >>> from headwise import MultiHeadAttention
        >>> from headwise.viz.maps import head_maps
        >>> m = head_maps(MultiHeadAttention(8, 2), torch.randn(4, 8))
        >>> w, n = decode(*encode(m))
        >>> bool((w[0] - m.weights).abs().max() <= 0.5 / 255), torch.equal(n[0], m.value_norms)
        (True, True)
    """
    raw = gzip.decompress(base64.b64decode(blob))
    L, h, s = len(meta["layers"]), len(meta["heads"]), meta["s"]
    n_w = L * h * s * s
    w = torch.frombuffer(bytearray(raw[:n_w]), dtype=torch.uint8).float().view(L, h, s, s) / meta["steps"]
    norms = torch.frombuffer(bytearray(raw[n_w:]), dtype=torch.uint8).view(-1, 4)
    norms = (norms.flip(1) if sys.byteorder == "big" else norms).contiguous().view(torch.float32).view(L, h, s)
    return w, norms


def _script_json(value: Any) -> str:
    # JSON inside <script>: escape "<", ">" and "&" so that no token can close the script element or open a tag.
    return (json.dumps(value, separators=(",", ":"))
            .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


def render_html(maps: HeadMaps | Sequence[HeadMaps], *, title: str | None = None) -> str:
    """The page as a string: the model view of every given layer x head (one HeadMaps: a single layer),
    each thumbnail opening into the head view (weights and writes, axis labels, tooltips).

    Shapes:
        maps: L HeadMaps with (h, s, s) weights and (h, s) value norms

    Example:
        >>> from headwise import MultiHeadAttention
        >>> from headwise.viz.maps import head_maps
        >>> page = render_html(head_maps(MultiHeadAttention(8, 2), torch.randn(3, 8), tokens=["a", "<b>", "c"]))
        >>> "http" in page.replace("http-equiv", ""), "<b>" in page
        (False, False)
    """
    if title is not None:  # before any work: a title the page's UTF-8 cannot hold is refused up front
        check_text("title", title)
    many = _as_list(maps)
    meta, blob = encode(many)
    if title is None:
        title = f"headwise: {default_title(many)}"
    meta["title"] = title
    return PAGE.substitute(title=html.escape(title), meta=_script_json(meta), blob=blob)


def save_html(maps: HeadMaps | Sequence[HeadMaps], path: str | Path, *, title: str | None = None) -> Path:
    """Write :func:`render_html` to ``path`` (UTF-8), atomically: a failed call leaves an existing file as it was.

    Shapes:
        maps: L HeadMaps with (h, s, s) weights
    """
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"save_html writes a .html file, got {str(path)!r}")
    page = render_html(maps, title=title).encode("utf-8")
    with write_atomically(path) as tmp:
        tmp.write_bytes(page)
    return path
