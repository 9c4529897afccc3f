"""A self-contained HTML page of :class:`~headwise.viz.statistics.HeadStatistics`: three layer x head grids
(mean entropy, mean max weight, first-token share; each cell's exact value on hover) and per-position curves of
chosen heads as inline SVG (no script, no network). Long sequences are drawn at most :data:`MAX_POINTS` points
a curve (the mean of each run of positions; the maximum for the key weights, so that a heavy key stays visible).

Shapes:
    grids (L, h); curves over s positions.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Sequence

import torch

from .files import check_text, write_atomically
from .statistics import SHARP_WEIGHT, SINK_SHARE, HeadStatistics

__all__ = ["render_statistics_html", "save_statistics_html", "MAX_POINTS"]

MAX_POINTS = 1024
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
_W, _H, _PAD = 420, 200, 46


def _cell(value: float, top: float) -> str:
    t = 0.0 if top <= 0 else min(1.0, value / top)
    light = 96 - 62 * t
    return f"background:hsl(265,60%,{light:.0f}%);color:{'#fff' if light < 55 else '#111'}"


# Why a held head's number is NaN: the share leaves out rows that may read only the first token (a one-token
# decoder text has no other row), so it is undefined, not missing.
_UNDEFINED = {"first-token share": "no query may read a key other than the first token"}


def _grid(stats: HeadStatistics, name: str, values: torch.Tensor, chosen: set[tuple[int, int]]) -> str:
    top = max(float(values.nan_to_num(0.0).max()) if values.numel() else 0.0, 1e-9) if name == "mean entropy" else 1.0
    head = "".join(f"<th>H{j}</th>" for j in range(values.shape[1]))
    rows = []
    for layer in range(values.shape[0]):
        cells, held = [], set(stats.held(layer))
        for j in range(values.shape[1]):
            v = float(values[layer, j])
            if j not in held:  # removed by head surgery, or never there (layers of different head counts)
                cells.append(f"<td title='layer {layer} head {j}: not in this layer'></td>")
                continue
            if v != v:
                why = _UNDEFINED.get(name, "undefined")
                cells.append(f"<td title='layer {layer} head {j}: {name} n/a: {why}'>n/a</td>")
                continue
            mark = " class='chosen'" if (layer, j) in chosen else ""
            cells.append(f"<td{mark} style='{_cell(v, top)}' title='layer {layer} head {j}: {name} {v:.4f}'>"
                         f"{v:.2f}</td>")
        rows.append(f"<tr><th>L{layer}</th>{''.join(cells)}</tr>")
    return (f"<figure><figcaption>{html.escape(name)}</figcaption><table><tr><th></th>{head}</tr>"
            f"{''.join(rows)}</table></figure>")


def _pooled(values: torch.Tensor, peak: bool) -> tuple[list[float], int]:
    """At most MAX_POINTS values (means, or maxima with ``peak``) and the positions each stands for."""
    s = values.numel()
    step = max(1, -(-s // MAX_POINTS))
    if step == 1:
        return values.tolist(), 1
    pad = (-s) % step
    padded = torch.cat([values, values[-1:].expand(pad)]) if pad else values
    runs = padded.view(-1, step)
    return (runs.amax(1) if peak else runs.mean(1)).tolist(), step


def _curves(stats: HeadStatistics, name: str, label: str, heads: Sequence[tuple[int, int]]) -> str:
    log = name == "key_weight"  # a sink's key receives hundreds of times the others': a log scale shows both
    series = [_pooled(getattr(stats, name)[layer, head], log) for layer, head in heads]
    top = max([max(v) for v, _ in series if v] + [1e-9])
    low = top * 1e-4
    if log:
        series = [([math.log10(max(x, low) / low) for x in v], step) for v, step in series]
    s = len(stats.tokens)
    span = math.log10(top / low) if log else top
    lines = []
    for c, ((values, step), (layer, head)) in enumerate(zip(series, heads)):
        n = max(len(values) - 1, 1)
        pts = " ".join(f"{_PAD + (_W - _PAD - 6) * i / n:.1f},{_H - _PAD - (_H - _PAD - 8) * v / span:.1f}"
                       for i, v in enumerate(values))
        lines.append(f"<polyline fill='none' stroke='{_COLORS[c % len(_COLORS)]}' stroke-width='1.2' points='{pts}'>"
                     f"<title>L{layer} H{head}</title></polyline>")
    axis = (f"<line x1='{_PAD}' y1='{_H - _PAD}' x2='{_W - 6}' y2='{_H - _PAD}' stroke='#888'/>"
            f"<line x1='{_PAD}' y1='8' x2='{_PAD}' y2='{_H - _PAD}' stroke='#888'/>"
            f"<text x='{_PAD - 4}' y='14' text-anchor='end'>{top:.2g}</text>"
            f"<text x='{_PAD - 4}' y='{_H - _PAD}' text-anchor='end'>{f'{low:.1g}' if log else '0'}</text>"
            f"<text x='{_PAD}' y='{_H - _PAD + 14}'>0</text>"
            f"<text x='{_W - 6}' y='{_H - _PAD + 14}' text-anchor='end'>{s - 1}</text>"
            f"<text x='{(_W + _PAD) / 2:.0f}' y='{_H - 6}' text-anchor='middle'>"
            f"{'key' if name == 'key_weight' else 'query'} position</text>")
    return (f"<figure><figcaption>{html.escape(label)}</figcaption><svg width='{_W}' height='{_H}' "
            f"viewBox='0 0 {_W} {_H}'>{axis}{''.join(lines)}</svg></figure>")


def render_statistics_html(stats: HeadStatistics, *, heads: Sequence[tuple[int, int]] | None = None,
                           title: str | None = None) -> str:
    """The page as a string (see the module docstring).

    Example:
        >>> st = HeadStatistics(["a", "b"], torch.zeros(1, 2, 2), torch.ones(1, 2, 2), torch.ones(1, 2, 2),
        ...                     torch.ones(2, dtype=torch.bool), "toy")
        >>> page = render_statistics_html(st)
        >>> page.startswith("<!DOCTYPE html>") and "first-token share" in page
        True
    """
    if title is not None:  # before any work: a title the page's UTF-8 cannot hold is refused up front
        check_text("title", title)
    heads = list(heads) if heads is not None else stats.chosen()
    stats.check_pairs(heads)
    grid, kinds = stats.grid(), stats.kinds()
    title = title or f"{stats.model + ': ' if stats.model else ''}every head, {len(stats.tokens)} tokens"
    legend = " ".join(f"<span style='color:{_COLORS[c % len(_COLORS)]}'>&#9632; L{a} H{b}</span>"
                      for c, (a, b) in enumerate(heads))

    def names(pairs: list[tuple[int, int]]) -> str:
        return ", ".join(f"L{a} H{b}" for a, b in pairs) or "none"

    curves = "".join(_curves(stats, n, label, heads) for n, label in (
        ("entropy", "entropy of each query (nats)"), ("max_weight", "max weight of each query"),
        ("key_weight", "weight each key received (sum over queries; log scale, peaks kept)")))
    style = ("body{font:14px system-ui,sans-serif;margin:20px;color:#222}figure{display:inline-block;"
             "vertical-align:top;margin:0 18px 18px 0}figcaption{font-weight:600;margin-bottom:4px}"
             "table{border-collapse:collapse;font-size:11px}td,th{padding:2px 4px;text-align:center}"
             "td{min-width:30px}td.chosen{outline:2px solid #00a0e0}svg text{font-size:10px;fill:#555}"
             "p{max-width:1100px}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body><h2>{html.escape(title)}</h2>"
            f"<p>Per-head statistics from <code>headwise.trace(capture=('lse', 'entropy', 'max_weight', "
            f"'key_weight'))</code>: no pattern was materialised. Means are over the {int(stats.reading.sum())} "
            f"positions that read something; a sink's share is on no key.</p>"
            f"<div>{''.join(_grid(stats, n, grid[n], set(heads)) for n in grid)}</div>"
            f"<p><b>sink heads</b> (first-token share &ge; {SINK_SHARE}, well above uniform attention's): "
            f"{names(kinds['sink'])}<br><b>sharp heads</b> (mean max weight &ge; {SHARP_WEIGHT}, well above uniform "
            f"attention's): {names(kinds['sharp'])}</p>"
            f"<h3>Per position {legend}</h3><div>{curves}</div></body></html>")


def save_statistics_html(stats: HeadStatistics, path: str | Path, *, heads: Sequence[tuple[int, int]] | None = None,
                         title: str | None = None) -> Path:
    """Write :func:`render_statistics_html` to ``path`` (.html or .htm), atomically: a failed call leaves an
    existing file as it was."""
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"save_statistics_html writes a .html file, got {str(path)!r}")
    page = render_statistics_html(stats, heads=heads, title=title).encode("utf-8")
    with write_atomically(path) as tmp:
        tmp.write_bytes(page)
    return path
