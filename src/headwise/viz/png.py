"""A PNG of the heads: one layer as a grid of heads (weights beside writes), a gallery of chosen (layer, head)
pairs the same way, or several layers as a model view (rows = layers, columns = heads, weights only). Heads
are numbered as the model had them before head surgery, where surgery changed them.

The layout stays legible at any length: past :data:`LABEL_ALL` tokens only every k-th token is labelled,
labels are cut to :data:`~headwise.viz.headmaps.LABEL_CHARS` characters (as on the page), a matrix larger
than its panel's pixels is max-pooled to at most one cell per pixel (so a sharp weight never falls between
pixels: nearest-neighbour drawing of more cells than pixels skips whole rows and columns), and the model view
draws at most :data:`MAX_ROWS` layers x :data:`MAX_COLS` heads. Whatever is left out is said in the figure and
in :func:`png_plan`'s ``notes`` (the command prints them on stderr). The file is written atomically.

Shapes:
    s: tokens, h: heads. Panels are (s, s): rows = query tokens i, columns = key (source) tokens j;
    weights alpha_ij, writes alpha_ij * ||v_j W_O^h||.
"""

from __future__ import annotations

import math
import textwrap
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .files import check_dpi, check_text, write_atomically
from .headmaps import HeadMaps, check_values, default_title, no_heads, short_label

__all__ = ["save_png", "png_layout", "png_plan", "PngPlan"]

PANEL_INCHES = 2.6
LONG_PANEL_INCHES = 4.0  # one layer past LABEL_ALL tokens: larger panels
MODEL_PANEL_INCHES = 1.3
TITLE_INCHES = 0.9  # the least room above the panels; a longer (wrapped) title gets more
TITLE_POINTS = 9
# An average character of the title font, and a line of it, in inches (DejaVu Sans, matplotlib's default).
CHAR_INCHES = TITLE_POINTS * 0.6 / 72
LINE_INCHES = TITLE_POINTS * 1.3 / 72
COLORBAR_INCHES = 1.0  # the column on the right that holds the colour scales
MIN_MODEL_INCHES = 6.0  # the model view of a small model stays wide enough for its title
LABEL_ALL = 48  # up to this many tokens every one is labelled
MAX_LABELS = 32  # past it, at most this many labels per axis
MAX_ROWS, MAX_COLS = 24, 16  # the model view's largest grid
# Gaps between panels, as fractions of a panel (matplotlib's wspace / hspace): one layer, then the model view.
SPACES = {True: (0.45, 0.45), False: (0.15, 0.25)}


def png_layout(n_heads: int, *, heads_per_row: int = 3, dpi: int = 100,
               panel_inches: float = PANEL_INCHES) -> tuple[int, int, int, int]:
    """(rows, columns of panels, width px, height px) of one layer's figure (two panels per head, and the
    colour scales on the right), with a title of up to three lines.

    Shapes:
        h heads -> ceil(h / heads_per_row) rows of 2 * heads_per_row panels

    Example:
        >>> png_layout(12)
        (4, 6, 1660, 1130)
    """
    _check_layout(heads_per_row, dpi)
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive int (a figure of heads), got {n_heads!r}")
    per_row = min(heads_per_row, n_heads)
    rows = math.ceil(n_heads / per_row)
    cols = 2 * per_row
    return (rows, cols, round((cols * panel_inches + COLORBAR_INCHES) * dpi),
            round((rows * panel_inches + TITLE_INCHES) * dpi))


@dataclass
class PngPlan:
    """What :func:`save_png` will draw: the grid, the panels ``(map index, head row, kind)``, the label
    step, ``notes`` naming everything left out or simplified, and the title wrapped to the figure's width.
    In the model view ``columns`` are the head numbers of its columns: each head is drawn in the column of its
    number (:attr:`HeadMaps.head_labels`), so layers of different head counts (after head surgery) line up.

    Shapes:
        panels: one per drawn (layer, head, kind) with kind "weights" or "writes"
    """

    rows: int
    cols: int
    width: int
    height: int
    panel_inches: float
    panels: list[tuple[int, int, str]]
    label_every: int
    notes: list[str] = field(default_factory=list)
    title_lines: list[str] = field(default_factory=list)
    columns: list[int] = field(default_factory=list)
    pool: int = 1  # each drawn cell is the maximum of pool x pool weights (1: every weight its own cell)

    @property
    def title_inches(self) -> float:
        return max(TITLE_INCHES, 0.45 + len(self.title_lines) * LINE_INCHES)


def png_plan(maps: HeadMaps | Sequence[HeadMaps], *, heads_per_row: int = 3, dpi: int = 100,
             title: str | None = None) -> PngPlan:
    """The layout :func:`save_png` uses for ``maps`` (one HeadMaps: the layer view; several: the model view).

    Shapes:
        maps: HeadMaps with (h, s, s) arrays, or a list of them (one per layer, same tokens)

    Example:
        >>> from headwise import MultiHeadAttention
        >>> from headwise.viz.maps import head_maps
        >>> p = png_plan(head_maps(MultiHeadAttention(8, 2), torch.randn(100, 8)))
        >>> (p.rows, p.cols, p.label_every), p.notes[0]
        ((1, 4, 4), 'token labels: every 4th of the 100 tokens')
    """
    _check_layout(heads_per_row, dpi)
    many = _as_list(maps)
    if title is not None:
        check_text("title", title)
    for i, token in enumerate(many[0].tokens):  # matplotlib's font code fails on them with a page of C++ types
        check_text(f"token {i}", token)
    s = len(many[0].tokens)
    notes: list[str] = []
    columns: list[int] = []
    every = 1 if s <= LABEL_ALL else math.ceil(s / MAX_LABELS)
    if len(many) == 1:
        m = many[0]
        inches = PANEL_INCHES if s <= 64 else LONG_PANEL_INCHES
        rows, cols, width, _ = png_layout(m.n_heads, heads_per_row=heads_per_row, dpi=dpi, panel_inches=inches)
        panels = [(0, i, kind) for i in range(m.n_heads) for kind in ("weights", "writes")]
        extra = 0.0
    else:
        inches = MODEL_PANEL_INCHES
        drawn_layers = min(len(many), MAX_ROWS)
        numbers = sorted({h for m in many[:drawn_layers] for h in m.head_labels})  # every head by its number
        if not numbers:
            raise ValueError(no_heads(many[0]) + "; so has every other layer given")
        columns = numbers[:MAX_COLS]
        rows, cols = drawn_layers, len(columns)
        width = round(max(cols * inches + COLORBAR_INCHES + 0.5, MIN_MODEL_INCHES) * dpi)
        extra = 0.6  # the bottom row's token labels
        panels = [(li, i, "weights") for li in range(drawn_layers) for i, h in enumerate(many[li].head_labels)
                  if h in columns]
        notes.append("model view: attention weights only (the writes are in the one-layer picture and the HTML page)")
        if drawn_layers < len(many):
            notes.append(f"only the first {drawn_layers} of {len(many)} layers are drawn (choose others with --layer)")
        if len(columns) < len(numbers):
            notes.append(f"only the first {len(columns)} of {len(numbers)} heads are drawn (choose with --heads)")
        counts = [m.n_heads for m in many[:drawn_layers]]
        # Judged on the drawn columns only: heads cut off past MAX_COLS leave no empty cell to explain.
        if any([h for h in m.head_labels if h in columns] != columns for m in many[:drawn_layers] if m.n_heads):
            notes.append(f"the layers hold different heads ({', '.join(map(str, counts))} heads): each is drawn in "
                         "the column of its number, the cells of heads a layer does not hold are empty")
        emptied = [m.layer for m in many[:drawn_layers] if not m.n_heads]
        if emptied:
            notes.append(f"layer{'s' if len(emptied) > 1 else ''} {', '.join(map(str, emptied))}: no head (head "
                         "surgery removed every one), an empty row")
        every = max(every, math.ceil(s / 8))  # small panels: a few labels on the outer axes only
    if every > 1:
        notes.append(f"token labels: every {_ordinal(every)} of the {s} tokens")
    plan = PngPlan(rows, cols, width, 0, inches, panels, every, notes, columns=columns)
    side = _panel_pixels(plan, _label_inches(many[0].tokens, every), dpi, extra, len(many) == 1)
    plan.pool = max(1, math.ceil(s / side))
    if plan.pool > 1:
        notes.append(f"each pixel shows the largest of up to {plan.pool} x {plan.pool} weights (max-pooled)")
    plan.title_lines = _title_lines(many, plan, title, width / dpi)
    plan.height = round((rows * inches + plan.title_inches + extra) * dpi)
    return plan


def _labels(tokens: list[str], every: int) -> tuple[list[int], float]:
    """The labelled positions and the labels' font size (points)."""
    ticks = list(range(0, len(tokens), every))
    return ticks, max(4.0, min(7.0, 90.0 / max(len(ticks), 1)))


def _label_inches(tokens: list[str], every: int) -> float:
    """The longest drawn label's length in inches (an average character is 0.6 of the font size wide)."""
    ticks, size = _labels(tokens, every)
    return max(len(short_label(tokens[j])) for j in ticks) * size * 0.6 / 72


def _margins(label_inches: float) -> tuple[float, float]:
    """(left, bottom) margins in inches: room for the labels beside and under the panels. Labels are at most
    LABEL_CHARS long, so these stay under a third of the smallest figure and no cap is needed."""
    return 0.15 + label_inches, max(0.8, 0.2 + label_inches)


def _panel_pixels(plan: PngPlan, label_inches: float, dpi: float, extra: float, one: bool) -> int:
    """The side, in whole pixels, of each panel's drawn square: the layout of :func:`save_png` worked out exactly
    (matplotlib's grid divides the room left of the colour scales and under the title among the panels and
    their gaps; an image of square cells then fills the largest square in its cell)."""
    left, bottom = _margins(label_inches)
    wspace, hspace = SPACES[one]
    width = plan.width / dpi - left - COLORBAR_INCHES
    height = plan.rows * plan.panel_inches + extra - bottom  # the title's room is above the panels' own
    cell = min(width / (plan.cols + wspace * (plan.cols - 1)), height / (plan.rows + hspace * (plan.rows - 1)))
    return max(1, math.floor(cell * dpi))


def _title_lines(many: list[HeadMaps], plan: PngPlan, title: str | None, width_inches: float) -> list[str]:
    """The figure's title, wrapped so that no line is wider than the figure."""
    one = len(many) == 1
    head = title or default_title(many)
    what = ("where each head reads from (blue, attention weights) and what it writes (orange, weight x "
            "||value W_O||, one scale for all heads)" if one else "attention weights of each head")
    parts = [f"{head}: {what}", "rows = query tokens, columns = key tokens; colour ~ square root of the value"]
    if plan.notes:
        parts.append("; ".join(plan.notes))
    chars = max(20, int((width_inches - 0.2) / CHAR_INCHES))
    return [line for part in parts for line in textwrap.wrap(part, chars, break_on_hyphens=False)]


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _check_layout(heads_per_row: object, dpi: object) -> None:
    if isinstance(heads_per_row, bool) or not isinstance(heads_per_row, int):
        raise TypeError(f"heads_per_row must be an int, got {type(heads_per_row).__name__}")
    if heads_per_row < 1:
        raise ValueError(f"heads_per_row must be at least 1, got {heads_per_row}")
    check_dpi(dpi)


def _as_list(maps: HeadMaps | Sequence[HeadMaps]) -> list[HeadMaps]:
    many = [maps] if isinstance(maps, HeadMaps) else list(maps)
    if not many or not all(isinstance(m, HeadMaps) for m in many):
        raise TypeError("maps must be a HeadMaps or a non-empty sequence of HeadMaps")
    if len(many) == 1 and not many[0].n_heads:  # the model view draws such a layer as an empty row
        raise ValueError(no_heads(many[0]))
    check_values(many)
    if any(m.tokens != many[0].tokens for m in many):
        raise ValueError("every HeadMaps of one picture must have the same tokens")
    if len(many) > 1 and any(m.layers is not None for m in many):
        raise ValueError("a gallery of (layer, head) pairs (head_gallery) is one HeadMaps: draw it on its own")
    return many


def _pooled(data: torch.Tensor, f: int) -> torch.Tensor:
    """``data`` max-pooled over f x f blocks (the last ones partial)."""
    if f == 1:
        return data.float()
    return torch.nn.functional.max_pool2d(data.float()[None, None], f, f, ceil_mode=True)[0, 0]


def save_png(maps: HeadMaps | Sequence[HeadMaps], path: str | Path, *, heads_per_row: int = 3, dpi: int = 100,
             title: str | None = None) -> Path:
    """Draw ``maps`` into a PNG: one layer as weights beside writes per head, several layers as the model
    view (see :func:`png_plan`, whose notes also appear at the bottom of the figure).

    Writes share one colour scale across heads so that heads can be compared: a head with sharp weights
    on tokens whose values are near zero stays pale on the right.

    Shapes:
        maps.weights, maps.writes: (h, s, s) -> an image of ``png_plan(maps)``'s width x height pixels
    """
    import matplotlib

    matplotlib.use("Agg", force=False)  # no display needed; keeps an interactive backend if one is active
    import matplotlib.pyplot as plt
    from matplotlib.colors import PowerNorm  # square-root colours: small weights stay visible at long lengths

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"save_png writes a .png file, got {str(path)!r}")
    many = _as_list(maps)
    plan = png_plan(many, heads_per_row=heads_per_row, dpi=dpi, title=title)
    s, tokens = len(many[0].tokens), many[0].tokens
    one = len(many) == 1
    width_in, height_in = plan.width / dpi, plan.height / dpi
    fig = plt.figure(figsize=(width_in, height_in), dpi=dpi)
    try:
        ticks, label_size = _labels(tokens, plan.label_every)
        labels = [short_label(tokens[j]) for j in ticks]
        left_in, bottom_in = _margins(_label_inches(tokens, plan.label_every))  # as png_plan sized the panels
        left, bottom, top = left_in / width_in, bottom_in / height_in, 1 - plan.title_inches / height_in
        wspace, hspace = SPACES[one]
        grid = fig.add_gridspec(plan.rows, plan.cols, left=left, right=1 - COLORBAR_INCHES / width_in, bottom=bottom,
                                top=top, wspace=wspace, hspace=hspace)
        known = [m.writes for m in many if m.writes is not None and m.n_heads]  # None: W_O not located
        vmax_writes = max([float(w.max()) for w in known] or [0.0]) or 1.0
        norms = {"weights": PowerNorm(0.5, vmin=0.0, vmax=1.0), "writes": PowerNorm(0.5, vmin=0.0, vmax=vmax_writes)}
        cmaps = {"weights": "Blues", "writes": "Oranges"}
        for n, (li, i, kind) in enumerate(plan.panels):
            m = many[li]
            if one:
                r, c = divmod(n // 2, plan.cols // 2)
                c = 2 * c + (kind == "writes")
            else:  # the row of its layer, the column of its number
                r, c = li, plan.columns.index(m.head_labels[i])
            ax = fig.add_subplot(grid[r, c])
            if kind == "writes" and m.writes is None:
                ax.set_axis_off()
                ax.text(0.5, 0.5, "writes not drawn:\nW_O not located", ha="center", va="center", fontsize=7,
                        transform=ax.transAxes)
                continue
            img = _pooled(m.weights[i] if kind == "weights" else m.writes[i], plan.pool)
            n_px = img.shape[-1] * plan.pool
            ax.imshow(img.numpy(), cmap=cmaps[kind], norm=norms[kind], interpolation="nearest",
                      extent=(-0.5, n_px - 0.5, n_px - 0.5, -0.5))
            ax.set_xlim(-0.5, s - 0.5)
            ax.set_ylim(s - 0.5, -0.5)
            for spine in ax.spines.values():  # a frame would hide cells of one pixel at the edges (a sink's key 0)
                spine.set_visible(False)
            name = "reads (weights)" if kind == "weights" else "writes ||a v W_O||"
            label = m.names[i] if m.layers is not None else f"head {m.head_labels[i]}"
            ax.set_title(f"{label}: {name}" if one else m.names[i], fontsize=7)
            ax.set_xticks(ticks)
            ax.set_yticks(ticks)
            # the model view labels the rows at each layer's first drawn head (a layer may lack the first number)
            first = None if one else min(plan.columns.index(h) for h in m.head_labels if h in plan.columns)
            outer_x, outer_y = one or r == plan.rows - 1, (one and kind == "weights") or (not one and c == first)
            # parse_math=False: a token such as "$" or "$x$" is text, never matplotlib mathtext
            ax.set_xticklabels(labels if outer_x else [], rotation=90, fontsize=label_size, parse_math=False)
            ax.set_yticklabels(labels if outer_y else [], fontsize=label_size, parse_math=False)
            ax.tick_params(length=0, pad=1)
        _colour_scales(fig, plt, norms, cmaps, ["weights", "writes"] if one and known else ["weights"],
                       x=(width_in - COLORBAR_INCHES + 0.25) / width_in, bottom=bottom, top=top, width=0.15 / width_in)
        fig.suptitle("\n".join(plan.title_lines), fontsize=TITLE_POINTS, parse_math=False)
        with warnings.catch_warnings(), write_atomically(path) as tmp:
            # a token in a script the font lacks (an emoji) is drawn as a box; matplotlib's warning per glyph
            # would reach the command's stderr as noise, and only that warning is silenced
            warnings.filterwarnings("ignore", r"Glyph \d+ .*missing from", UserWarning)
            fig.savefig(tmp, dpi=dpi)
    finally:
        plt.close(fig)
    return path


def _colour_scales(fig, plt, norms, cmaps, kinds, *, x: float, bottom: float, top: float, width: float) -> None:
    """One colour bar per drawn kind, stacked in the right-hand column, titled with what it measures; its
    ticks at fixed fractions of the scale (the colours are square-root spaced)."""
    from matplotlib.ticker import FormatStrFormatter

    titles = {"weights": "weight", "writes": "write"}
    gap = 0.12 * (top - bottom) if len(kinds) > 1 else 0.0
    height = min((top - bottom - gap * (len(kinds) - 1)) / len(kinds), 0.5)
    for k, kind in enumerate(kinds):
        y = top - (k + 1) * height - k * gap
        cax = fig.add_axes((x, y, width, height))
        bar = fig.colorbar(plt.cm.ScalarMappable(norm=norms[kind], cmap=cmaps[kind]), cax=cax)
        vmax = norms[kind].vmax
        bar.set_ticks([f * vmax for f in (0.0, 0.1, 0.25, 0.5, 1.0)])
        bar.ax.yaxis.set_major_formatter(FormatStrFormatter("%.2g"))
        bar.ax.tick_params(labelsize=6)
        bar.ax.set_title(titles[kind], fontsize=7)
