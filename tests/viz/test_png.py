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


def _one_hot_maps(s: int, n_layers: int, n_heads: int, cell: tuple[int, int]):
    """HeadMaps whose only non-zero weight (1.0) sits at ``cell`` of every head (rows need not sum to 1 here)."""
    import torch

    from headwise.viz.maps import HeadMaps

    out = []
    for layer in range(n_layers):
        w = torch.zeros(n_heads, s, s)
        w[:, cell[0], cell[1]] = 1.0
        norms = torch.ones(n_heads, s)
        out.append(HeadMaps([f"t{i}" for i in range(s)], layer, w, w * norms[:, None, :], norms))
    return out


def test_long_inputs_keep_sharp_weights_and_say_what_they_leave_out(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    from headwise.viz.png import MAX_COLS, png_plan

    s = 300
    maps = _one_hot_maps(s, 2, MAX_COLS + 2, (201, 157))
    plan = png_plan(maps)
    assert (plan.rows, plan.cols) == (2, MAX_COLS)
    assert any(f"only the first {MAX_COLS} of {MAX_COLS + 2} heads are drawn" in n for n in plan.notes)
    assert any(n.startswith("token labels: every ") for n in plan.notes)
    assert any("max-pooled" in n for n in plan.notes)
    path = save_png(maps, tmp_path / "model.png")
    img = np.asarray(Image.open(path).convert("RGB"), dtype=np.int32)
    assert img.shape[:2] == (plan.height, plan.width)
    # a panel is ~100 px for 300 tokens: the one weight of 1.0 survives as a dark pixel in every panel
    dark = (img[..., 0] < 80) & (img[..., 2] > img[..., 0] + 40)
    assert dark.sum() >= plan.rows * plan.cols

    one = png_plan(maps[0])
    assert one.cols == 6 and one.label_every == -(-s // 32) and not any("heads are drawn" in n for n in one.notes)
