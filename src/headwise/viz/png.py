"""A PNG grid of every head of a layer: its attention weights and, beside them, what it writes.

Shapes:
    s: tokens, h: heads. Each head gets two (s, s) panels: weights alpha_ij and writes
    alpha_ij * ||v_j W_O^h||, rows = query tokens i, columns = source tokens j.
"""

from __future__ import annotations

import math
from pathlib import Path

from .maps import HeadMaps

__all__ = ["save_png", "png_layout"]

PANEL_INCHES = 2.6
TITLE_INCHES = 0.9


def png_layout(n_heads: int, *, heads_per_row: int = 3, dpi: int = 100) -> tuple[int, int, int, int]:
    """(rows, columns of panels, width px, height px) of the figure :func:`save_png` draws.

    Shapes:
        h heads -> ceil(h / heads_per_row) rows of 2 * heads_per_row panels

    Example:
        >>> png_layout(12)
        (4, 6, 1560, 1130)
    """
    per_row = min(heads_per_row, n_heads)
    rows = math.ceil(n_heads / per_row)
    cols = 2 * per_row
    return rows, cols, round(cols * PANEL_INCHES * dpi), round((rows * PANEL_INCHES + TITLE_INCHES) * dpi)


def save_png(maps: HeadMaps, path: str | Path, *, heads_per_row: int = 3, dpi: int = 100) -> Path:
    """Draw every head of ``maps`` (weights beside writes, token labels on both axes) into a PNG.

    Writes share one colour scale across heads so that heads can be compared: a head with sharp weights
    on tokens whose values are near zero stays pale on the right.

    Shapes:
        maps.weights, maps.writes: (h, s, s) -> an image of ``png_layout(h)[2:]`` pixels
    """
    import matplotlib

    matplotlib.use("Agg", force=False)  # no display needed; keeps an interactive backend if one is active
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"save_png writes a .png file, got {str(path)!r}")
    h, s = maps.n_heads, len(maps.tokens)
    rows, cols, width, height = png_layout(h, heads_per_row=heads_per_row, dpi=dpi)
    fig = plt.figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    try:
        top = 1 - TITLE_INCHES / (height / dpi)
        grid = fig.add_gridspec(rows, cols, left=0.05, right=0.99, bottom=0.04, top=top, wspace=0.45, hspace=0.45)
        vmax_writes = float(maps.writes.max()) or 1.0
        label_size = max(4.0, min(7.0, 90.0 / max(s, 1)))
        for i in range(h):
            r, c = divmod(i, cols // 2)
            for k, (name, data, vmax, cmap) in enumerate((("reads (weights)", maps.weights[i], 1.0, "Blues"),
                                                         ("writes ||a v W_O||", maps.writes[i], vmax_writes, "Oranges"))):
                ax = fig.add_subplot(grid[r, 2 * c + k])
                ax.imshow(data.float().numpy(), cmap=cmap, vmin=0.0, vmax=vmax, interpolation="nearest")
                ax.set_title(f"head {i}: {name}", fontsize=7)
                ax.set_xticks(range(s))
                ax.set_yticks(range(s))
                ax.set_xticklabels(maps.tokens, rotation=90, fontsize=label_size)
                ax.set_yticklabels(maps.tokens if k == 0 else [], fontsize=label_size)
                ax.tick_params(length=0, pad=1)
        fig.suptitle(f"Layer {maps.layer}: where each head reads from (blue, attention weights) and what it writes "
                     f"(orange, weight x ||value W_O||, one scale for all heads)\nrows = query token, "
                     f"columns = source token", fontsize=9)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
    return path
