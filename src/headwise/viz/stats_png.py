"""A PNG of :class:`~headwise.viz.statistics.HeadStatistics`: three layer x head grids (mean entropy, mean max
weight, first-token share) above per-position curves of chosen heads (entropy and max weight of each query,
weight each key received), with the sink and sharp heads named under the grids.

Shapes:
    grids (L, h); curves over s positions.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Sequence

from .files import check_dpi, check_text, write_atomically
from .statistics import SHARP_WEIGHT, SINK_SHARE, HeadStatistics

__all__ = ["save_statistics_png"]

_GRIDS = (("mean entropy", "viridis", "nats"), ("mean max weight", "magma", "weight"),
          ("first-token share", "magma", "weight"))
# The footer naming the sink and sharp heads: wrapped to the figure's width (a character is about 0.6 of the font
# size wide, as png.py's titles assume), each extra line adding height below the curves.
_FOOTER_POINTS = 8
_FOOTER_CHAR_INCHES = _FOOTER_POINTS * 0.6 / 72
_FOOTER_LINE_INCHES = _FOOTER_POINTS * 1.3 / 72
_CURVES = (("entropy", "entropy of each query (nats)"), ("max_weight", "max weight of each query"),
           ("key_weight", "weight each key received (sum over queries)"))


def save_statistics_png(stats: HeadStatistics, path: str | Path, *, heads: Sequence[tuple[int, int]] | None = None,
                        title: str | None = None, dpi: int = 100) -> Path:
    """Draw ``stats`` into ``path`` (.png): the grids, then curves of ``heads`` ((layer, head) pairs; default
    :meth:`HeadStatistics.chosen`). Needs matplotlib. Written atomically: a failed call leaves an existing file
    as it was.

    Shapes:
        stats arrays (L, h, s) -> one figure of three grids and three curve panels
    """
    import matplotlib

    matplotlib.use("Agg", force=False)  # no display needed; keeps an interactive backend if one is active
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"save_statistics_png writes a .png file, got {str(path)!r}")
    check_dpi(dpi)
    if title is not None:
        check_text("title", title)
    heads = list(heads) if heads is not None else stats.chosen()
    stats.check_pairs(heads)  # before the figure: a head the layer does not hold has no curve
    grid, kinds = stats.grid(), stats.kinds()
    L, h, s = stats.n_layers, stats.n_heads, len(stats.tokens)
    cell = min(0.5, 4.2 / max(h, 1))
    width = max(13.0, 3 * (h * cell + 1.2))
    grid_h = max(2.0, L * cell + 1.0)
    footer = _footer_lines(kinds, width)
    extra = (len(footer) - 1) * _FOOTER_LINE_INCHES
    height = grid_h + 4.6 + extra
    fig = plt.figure(figsize=(width, height), dpi=dpi)
    try:
        spec = fig.add_gridspec(2, 3, height_ratios=[grid_h, 3.2], hspace=0.55, wspace=0.3,
                                top=1 - 0.75 / height, bottom=(0.9 + extra) / height, left=0.05, right=0.96)
        for c, (name, cmap, unit) in enumerate(_GRIDS):
            ax = fig.add_subplot(spec[0, c])
            values = grid[name].numpy()  # NaN (drawn blank): a head the layer does not hold, or a number undefined
            top = max(float(grid[name].nan_to_num(0.0).max()) if values.size else 0.0, 1e-9) \
                if name == "mean entropy" else 1.0
            im = ax.imshow(values, cmap=cmap, vmin=0.0, vmax=top, aspect="auto", interpolation="nearest")
            ax.set_title(name, fontsize=10)
            ax.set_xlabel("head", fontsize=8)
            ax.set_ylabel("layer", fontsize=8)
            ax.set_xticks(range(0, h, max(1, h // 16)))
            ax.set_yticks(range(0, L, max(1, L // 16)))
            ax.tick_params(labelsize=7)
            for layer, head in heads:
                ax.add_patch(plt.Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="#00c8ff", lw=1.5))
            if L * h <= 160:
                for layer in range(L):
                    for head in stats.held(layer):
                        v = float(values[layer, head])
                        if v != v:  # held, but undefined (a share with no row counted): said, not left blank
                            ax.text(head, layer, "n/a", ha="center", va="center", fontsize=6, color="#555")
                            continue
                        ax.text(head, layer, f"{v:.2f}" if v < 10 else f"{v:.1f}", ha="center", va="center",
                                fontsize=6, color="white" if v < 0.6 * top else "black")
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02).set_label(unit, fontsize=7)
        positions = range(s)
        for c, (name, label) in enumerate(_CURVES):
            ax = fig.add_subplot(spec[1, c])
            values = getattr(stats, name)
            for layer, head in heads:
                ax.plot(positions, values[layer, head].numpy(), lw=0.9, label=f"L{layer} H{head}")
            if name == "key_weight":
                ax.set_yscale("symlog", linthresh=1e-2)
            ax.set_title(label, fontsize=9)
            ax.set_xlabel("key position" if name == "key_weight" else "query position", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if c == 0:
                ax.legend(fontsize=7, loc="best")
        # parse_math=False: a model name or title such as "$x$" is text, never matplotlib mathtext
        fig.suptitle(title or f"{stats.model + ': ' if stats.model else ''}every head, {s} tokens", fontsize=11,
                     parse_math=False)
        fig.text(0.05, 0.2 / height, "\n".join(footer), fontsize=_FOOTER_POINTS, va="bottom", parse_math=False)
        with write_atomically(path) as tmp:
            fig.savefig(tmp, dpi=dpi)
    finally:
        plt.close(fig)
    return path


def _footer_lines(kinds: dict[str, list[tuple[int, int]]], width_inches: float) -> list[str]:
    """The sink and sharp heads, wrapped so that no line runs past the figure's right edge (it starts at 5%)."""
    chars = max(20, int((0.95 * width_inches - 0.2) / _FOOTER_CHAR_INCHES))
    return textwrap.wrap(_kinds_line(kinds), chars, break_on_hyphens=False)


def _kinds_line(kinds: dict[str, list[tuple[int, int]]]) -> str:
    def names(pairs: list[tuple[int, int]]) -> str:
        shown = ", ".join(f"L{a} H{b}" for a, b in pairs[:12])
        return (shown + f" (+{len(pairs) - 12} more)" if len(pairs) > 12 else shown) or "none"

    return (f"sink heads (first-token share >= {SINK_SHARE}, well above uniform attention's): "
            f"{names(kinds['sink'])}.   sharp heads (mean max weight >= {SHARP_WEIGHT}, well above uniform "
            f"attention's, sinks left out): {names(kinds['sharp'])}.   Boxed: the heads drawn below.")
