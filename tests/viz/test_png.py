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


def _dark(rgb: np.ndarray) -> np.ndarray:
    return rgb.sum(-1) < 3 * 160  # text and strong colours, not the white background or pale cells


@pytest.mark.parametrize("n_layers", [1, 2])
def test_the_title_stays_inside_a_small_figure(tmp_path, n_layers) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    maps = _one_hot_maps(10, n_layers, 3, (4, 2))  # a small model: the model view is three panels wide
    title = "headwise: a-checkpoint-with-a-long-name, all 2 layers, heads 0,1,2, 10 tokens"
    img = np.asarray(Image.open(save_png(maps, tmp_path / "m.png", title=title)).convert("RGB"), dtype=np.int32)
    band = _dark(img[:60])  # the title's first lines, above the panels
    assert band.sum() > 500  # the title is drawn
    columns = np.flatnonzero(band.any(0))
    assert columns.min() > 2 and columns.max() < img.shape[1] - 3, (columns.min(), columns.max(), img.shape)


def _colour_bar_columns(rgb: np.ndarray, strip: int) -> list[int]:
    """Columns of the right-hand ``strip`` whose pixels run, top to bottom, monotonically from dark to light
    through at least 40 distinct shades: a colour scale (a panel's cells are a few flat blocks)."""
    found = []
    for x in range(rgb.shape[1] - strip, rgb.shape[1]):
        col = rgb[:, x].sum(-1)
        coloured = np.flatnonzero(col < 3 * 250)
        if len(coloured) < 40:
            continue
        run = col[coloured.min():coloured.max() + 1]
        inner = run[2:-2]  # the bar's black frame at either end
        if len(np.unique(inner)) >= 40 and (np.diff(inner) >= 0).mean() > 0.97:
            found.append(x)
    return found


def test_every_png_has_its_colour_scales(maps, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    strip = 110  # px: the colour-scale column of the figure
    one = np.asarray(Image.open(save_png(maps, tmp_path / "one.png")).convert("RGB"), dtype=np.int32)
    bars = _colour_bar_columns(one, strip)
    assert bars, "no colour scale in the one-layer picture"
    x = bars[len(bars) // 2]
    col = one[:, x]
    blue = (col[:, 2] > col[:, 0] + 40).sum()
    orange = (col[:, 0] > col[:, 2] + 40).sum()
    assert blue > 30 and orange > 30  # a weights (blue) and a writes (orange) scale, one above the other
    model = np.asarray(Image.open(save_png(_one_hot_maps(12, 3, 4, (3, 1)), tmp_path / "model.png")).convert("RGB"),
                       dtype=np.int32)
    assert _colour_bar_columns(model, strip), "no colour scale in the model view"


def test_dollar_signs_in_tokens_and_titles_are_text(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    import torch
    from matplotlib.text import Text

    from headwise.viz.maps import HeadMaps

    tokens = ["$", "$$", "$x^$", "a$b$c", "\\$"]
    w = torch.full((2, 5, 5), 0.2)
    maps = HeadMaps(tokens, 0, w, w, torch.ones(2, 5))
    figures = []
    real_close = plt.close
    plt_close = lambda fig=None: figures.append(fig)  # noqa: E731 - keep the figure to read its texts
    try:
        plt.close = plt_close
        path = save_png(maps, tmp_path / "dollars.png", title="cost $5, or $$ and $\\frac$")
    finally:
        plt.close = real_close
    assert path.read_bytes()[:4] == b"\x89PNG"
    fig = figures[0]
    texts = [t for t in fig.findobj(Text) if "$" in t.get_text()]
    labels = {t.get_text() for t in texts}
    assert set(tokens) <= labels and any("cost $5, or $$ and $\\frac$" in t for t in labels)
    assert all(not t.get_parse_math() for t in texts)  # drawn as the characters they are, never mathtext
    real_close(fig)


def _drawn(maps, tmp_path, **kw):
    """{panel title: the array it shows} of save_png's figure, and the figure's plan."""
    import matplotlib.pyplot as plt

    from headwise.viz.png import png_plan

    figures = []
    real_close = plt.close
    try:
        plt.close = lambda fig=None: figures.append(fig)
        save_png(maps, tmp_path / "drawn.png", **kw)
    finally:
        plt.close = real_close
    fig = figures[0]
    shown = {ax.get_title(): np.asarray(ax.images[0].get_array()) for ax in fig.axes if ax.images and ax.get_title()}
    real_close(fig)
    return shown, png_plan(maps, **kw)


def _maps_of_heads(layer: int, heads: tuple[int, ...], s: int = 5, seed: int = 0):
    """A HeadMaps of ``heads`` (numbers before head surgery) with random rows that sum to 1."""
    import torch

    from headwise.viz.maps import HeadMaps

    g = torch.Generator().manual_seed(seed)
    w = torch.rand(len(heads), s, s, generator=g).softmax(-1)
    norms = torch.rand(len(heads), s, generator=g)
    return HeadMaps([f"t{i}" for i in range(s)], layer, w, w * norms[:, None, :], norms,
                    original_heads=None if heads == tuple(range(len(heads))) else heads)


@pytest.mark.parametrize("order", [[0, 1, 2], [1, 0, 2]])
def test_the_model_view_draws_every_head_of_layers_with_different_head_counts(tmp_path, order) -> None:
    pytest.importorskip("matplotlib")
    layers = [_maps_of_heads(0, (0, 1, 2, 3), seed=1), _maps_of_heads(1, (1, 2), seed=2),
              _maps_of_heads(2, (0, 1, 2, 3), seed=3)]
    maps = [layers[i] for i in order]
    shown, plan = _drawn(maps, tmp_path)
    want = {name: m.weights[i].numpy() for m in maps for i, name in enumerate(m.names)}
    assert sorted(shown) == sorted(want) and len(shown) == 10  # every head, under its number, none twice
    for name, data in shown.items():
        np.testing.assert_array_equal(data, want[name])
    assert plan.columns == [0, 1, 2, 3] and (plan.rows, plan.cols) == (3, 4)
    assert any("the layers hold different heads" in n for n in plan.notes)


def test_the_different_heads_note_judges_the_drawn_columns_only() -> None:
    """Layers that hold the same heads, more than MAX_COLS of them, leave no empty cell: no note of different
    heads. A layer without one of the drawn heads (head surgery) still gets the note."""
    from headwise.viz.png import MAX_COLS, png_plan

    n = MAX_COLS + 4
    same = [_maps_of_heads(layer, tuple(range(n)), seed=layer) for layer in range(2)]
    plan = png_plan(same)
    assert plan.columns == list(range(MAX_COLS))
    assert not any("different heads" in note for note in plan.notes), plan.notes
    assert any(f"only the first {MAX_COLS} of {n} heads are drawn" in note for note in plan.notes)
    # beyond the drawn columns only: still the same cells
    cut_late = [same[0], _maps_of_heads(1, tuple(range(MAX_COLS + 1)), seed=1)]
    assert not any("different heads" in note for note in png_plan(cut_late).notes)
    # head 3 gone from layer 1: its cell in a drawn column is empty, and the note says why
    gone = [same[0], _maps_of_heads(1, tuple(h for h in range(n) if h != 3), seed=1)]
    assert any("the layers hold different heads" in note for note in png_plan(gone).notes)


def test_a_layer_without_heads_is_refused_alone_and_an_empty_row_in_the_model_view(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    import torch

    from headwise.viz.maps import HeadMaps
    from headwise.viz.png import png_plan

    empty = HeadMaps([f"t{i}" for i in range(5)], 1, torch.zeros(0, 5, 5), torch.zeros(0, 5, 5),
                     torch.zeros(0, 5), original_heads=())
    with pytest.raises(ValueError, match="layer 1 has no head to draw: head surgery removed every head"):
        png_plan(empty)
    with pytest.raises(ValueError, match="layer 1 has no head to draw"):
        save_png(empty, tmp_path / "e.png")
    assert not (tmp_path / "e.png").exists()
    full = _maps_of_heads(0, (0, 1))
    shown, plan = _drawn([full, empty], tmp_path)
    assert sorted(shown) == ["L0 H0", "L0 H1"]
    assert any("layer 1: no head" in n for n in plan.notes)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5, 3.0])
def test_png_refuses_weights_that_are_not_probabilities(tmp_path, bad) -> None:
    m = _maps_of_heads(0, (0, 1))
    m.weights[1, 2, 3] = bad
    with pytest.raises(ValueError, match=r"must be finite and in \[0, 1\]"):
        save_png(m, tmp_path / "nan.png")
    assert not (tmp_path / "nan.png").exists()


@pytest.mark.parametrize("kw, error, match", [
    (dict(heads_per_row=0), ValueError, "heads_per_row must be at least 1, got 0"),
    (dict(heads_per_row=-2), ValueError, "heads_per_row must be at least 1, got -2"),
    (dict(heads_per_row=2.5), TypeError, "heads_per_row must be an int, got float"),
    (dict(dpi=0), ValueError, "dpi must be a positive finite number, got 0"),
    (dict(dpi=float("nan")), ValueError, "dpi must be a positive finite number"),
    (dict(dpi="100"), TypeError, "dpi must be a number, got str"),
    (dict(dpi=100000), ValueError, r"dpi must be between 10 and 600 \(dots per inch\), got 100000"),
    (dict(dpi=5), ValueError, r"dpi must be between 10 and 600 \(dots per inch\), got 5"),
])
def test_png_checks_heads_per_row_and_dpi(tmp_path, kw, error, match) -> None:
    from headwise.viz.png import png_plan

    m = _maps_of_heads(0, (0, 1, 2, 3))
    with pytest.raises(error, match=match):
        save_png(m, tmp_path / "k.png", **kw)
    with pytest.raises(error, match=match):
        png_plan(m, **kw)
    with pytest.raises(error, match=match):
        png_layout(4, **kw)


@pytest.mark.parametrize("kw, tokens, error, match", [
    (dict(title=5), None, TypeError, "title must be a str, got int 5"),
    (dict(title="bad \udcff"), None, ValueError, r"title must be valid Unicode .* got '\\udcff' at character 4"),
    ({}, ["a", "\udcff", "b"], ValueError, r"token 1 must be valid Unicode .* got '\\udcff' at character 0"),
])
def test_png_refuses_text_a_file_cannot_hold_and_leaves_the_file_as_it_was(tmp_path, kw, tokens, error, match) -> None:
    import torch

    from headwise.viz.maps import HeadMaps

    w = torch.full((2, 3, 3), 1 / 3)
    m = HeadMaps(tokens or ["a", "b", "c"], 0, w, w, torch.ones(2, 3))
    path = tmp_path / "old.png"
    path.write_bytes(b"old picture")
    with pytest.raises(error, match=match):
        save_png(m, path, **kw)
    assert path.read_bytes() == b"old picture"


def test_a_png_that_fails_while_being_written_leaves_the_old_file(tmp_path, savefig_fails_halfway) -> None:
    path = tmp_path / "old.png"
    path.write_bytes(b"old picture")
    with pytest.raises(OSError, match="No space left"):
        save_png(_maps_of_heads(0, (0, 1)), path)
    assert path.read_bytes() == b"old picture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.png"]  # no scratch file left behind


def test_long_token_labels_are_cut_as_on_the_page_and_stay_inside_the_figure(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    import warnings

    import matplotlib.pyplot as plt
    import torch

    from headwise.viz.maps import HeadMaps

    tokens = ["L" * 300, "cat", "\U0001f642", "exactly12chr", "thirteen-char"]
    w = torch.full((2, 5, 5), 0.2)
    figures = []
    real_close = plt.close
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            plt.close = lambda fig=None: figures.append(fig)
            save_png(HeadMaps(tokens, 0, w, w, torch.ones(2, 5)), tmp_path / "long.png")
        finally:
            plt.close = real_close
    fig = figures[0]
    want = ["L" * 11 + "\u2026", "cat", "\U0001f642", "exactly12chr", "thirteen-ch\u2026"]  # as the page's short()
    labelled = [ax for ax in fig.axes if ax.images and ax.get_yticklabels()[0].get_text()]
    assert [t.get_text() for t in labelled[0].get_yticklabels()] == want
    assert [t.get_text() for t in labelled[0].get_xticklabels()] == want
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    for ax in labelled:
        for t in ax.get_xticklabels() + ax.get_yticklabels():
            e = t.get_window_extent(renderer)
            assert box.x0 <= e.x0 and e.x1 <= box.x1 and box.y0 <= e.y0 and e.y1 <= box.y1, (t.get_text(), e, box)
    real_close(fig)
    # the emoji has no glyph in matplotlib's font: drawn as a box, without a warning per glyph on stderr
    assert not [w for w in caught if "Glyph" in str(w.message)], [str(w.message) for w in caught]
