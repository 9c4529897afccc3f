"""The PNG grid: a valid PNG of the expected size whose head panels show different data."""

from __future__ import annotations

import numpy as np
import pytest

from headwise.viz.png import png_layout, save_png


def test_png_size_and_panels(maps, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    path = save_png(maps, tmp_path / "heads.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = Image.open(path)
    img.verify()
    rows, cols, width, height = png_layout(maps.n_heads)
    assert (rows, cols) == (4, 6)
    img = Image.open(path).convert("RGB")
    assert img.size == (width, height)
    rgb = np.asarray(img, dtype=np.int32)
    r, b = rgb[..., 0], rgb[..., 2]
    assert (b > r + 40).sum() > 1000 and (r > b + 40).sum() > 1000  # blue weights and orange writes drawn
    # per-head panels differ: the arrays behind them, and the pixels of two heads' weight panels
    assert not np.allclose(maps.weights[0].numpy(), maps.weights[1].numpy(), atol=1e-2)
    panel_w, panel_h = width // cols, (height - 90) // rows
    top = 90
    p0 = rgb[top:top + panel_h, 0:panel_w]
    p1 = rgb[top:top + panel_h, 2 * panel_w:3 * panel_w]
    assert np.abs(p0 - p1).mean() > 1.0


def test_png_checks_suffix(maps, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"\.png"):
        save_png(maps, tmp_path / "heads.jpg")
