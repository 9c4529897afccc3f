"""Long inputs in the PNG: a matrix with more cells than its panel has pixels is max-pooled to the panel's real
size, so that every sharp weight leaves a dark pixel where it belongs, and the figure says it pooled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headwise.viz.maps import HeadMaps
from headwise.viz.png import png_plan, save_png


def _drawn_with_axes(maps, path):
    """The PNG's pixels (summed over RGB) and, per weights panel, its drawn square in PNG pixel coordinates
    (x0, y0, x1, y1) as the laid-out figure reports it, and the figure's title."""
    import matplotlib.pyplot as plt
    from PIL import Image

    figures = []
    real_close = plt.close
    try:
        plt.close = lambda fig=None: figures.append(fig)
        save_png(maps, path)
    finally:
        plt.close = real_close
    fig = figures[0]
    rgb = np.asarray(Image.open(path).convert("RGB"), dtype=np.int64)
    # a pixel of the blue map's dark end (a weight near 1): dark, and blue, unlike a black frame or text
    img = np.where((rgb.sum(-1) < 300) & (rgb[..., 2] - rgb[..., 0] > 50), 0, 765)
    height = img.shape[0]
    boxes = []
    for ax in fig.axes:
        if ax.images and "weights" in ax.get_title():
            bb = ax.get_window_extent()
            boxes.append((bb.x0, height - bb.y1, bb.x1, height - bb.y0))  # matplotlib's y runs upwards
    title = fig._suptitle.get_text()
    real_close(fig)
    return img, boxes, title


@pytest.mark.parametrize("s, h", [(64, 3), (250, 12), (300, 3), (300, 12), (600, 3)])
def test_every_weight_of_one_in_permutation_heads_leaves_a_dark_pixel_where_it_belongs(tmp_path, s, h) -> None:
    pytest.importorskip("matplotlib")
    gen = torch.Generator().manual_seed(s + h)
    perms = [torch.randperm(s, generator=gen) for _ in range(h)]
    w = torch.zeros(h, s, s)
    for k, p in enumerate(perms):
        w[k, torch.arange(s), p] = 1.0  # each query reads exactly one key
    maps = HeadMaps([f"t{i}" for i in range(s)], 0, w, None, None)
    img, boxes, title = _drawn_with_axes(maps, tmp_path / "perm.png")
    assert len(boxes) == h
    lost = []
    for k, (x0, y0, x1, y1) in enumerate(boxes):
        for i in range(s):  # cell (i, j) is centred at a fraction (j + 0.5) / s across, (i + 0.5) / s down
            j = int(perms[k][i])
            x, y = int(x0 + (j + 0.5) / s * (x1 - x0)), int(y0 + (i + 0.5) / s * (y1 - y0))
            window = img[max(0, y - 2):y + 3, max(0, x - 2):x + 3]
            if window.min() > 300:  # no pixel near the colour of a weight of 1 (the blue map's darkest)
                lost.append((k, i, j))
    assert not lost, f"{len(lost)} of {h * s} weights of 1 left no dark pixel, e.g. {lost[:5]}"

    side = min(min(x1 - x0, y1 - y0) for x0, y0, x1, y1 in boxes)  # the panel's pixels, as drawn
    plan = png_plan(maps)
    pooled = [n for n in plan.notes if "max-pooled" in n]
    if s > side:  # more cells than pixels: pooled, at most one cell per pixel, and said in the plan and figure
        assert -(-s // plan.pool) <= side < -(-s // (plan.pool - 1))
        assert pooled == [f"each pixel shows the largest of up to {plan.pool} x {plan.pool} weights (max-pooled)"]
        assert "max-pooled" in title
    else:
        assert plan.pool == 1 and not pooled and "max-pooled" not in title
