"""The HTML page: self-contained, carries the traced data (to the quantisation step), escapes tokens, and,
in headless Chromium, draws every head and shows the tokens and values of the cell under the pointer."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
import torch

from headwise import MultiHeadAttention
from headwise.viz.html import QUANT_STEPS, decode, render_html, save_html
from headwise.viz.maps import HeadMaps, head_maps

STEP = 0.5 / QUANT_STEPS  # the largest quantisation error of a stored weight


def embedded(page: str) -> tuple[dict, str]:
    """(metadata, base64 blob) as the page carries them."""
    meta = re.search(r'<script id="headwise-meta" type="application/json">(.*?)</script>', page, re.S).group(1)
    blob = re.search(r'<script id="headwise-data" type="application/octet-stream">(.*?)</script>', page, re.S).group(1)
    return json.loads(meta), blob


def test_page_is_self_contained_and_carries_the_data(maps: HeadMaps) -> None:
    page = render_html(maps)
    meta, blob = embedded(page)
    assert meta["tokens"] == maps.tokens and meta["layers"] == [maps.layer] and meta["heads"] == list(range(12))
    w, norms = decode(meta, blob)
    torch.testing.assert_close(w[0], maps.weights.float(), atol=STEP + 1e-7, rtol=0)
    assert torch.equal((w[0] * QUANT_STEPS).round(), (maps.weights.float() * QUANT_STEPS).round())
    torch.testing.assert_close(norms[0], maps.value_norms.float(), atol=0, rtol=0)
    # the page's writes (weight x norm, computed in the browser) scale by the largest quantised write
    assert meta["max_write"] == pytest.approx(float((w[0] * norms[0][:, None, :]).max()), rel=1e-6)
    # no network: no URL anywhere, no src/href, and the CSP forbids loading anything
    assert not re.findall(r"https?://", page.replace("http-equiv", ""))
    assert not re.search(r"\s(src|href)\s*=", page)
    assert "default-src 'none'" in page


def test_several_layers_and_chosen_heads_round_trip() -> None:
    attn = MultiHeadAttention(16, 4)
    layers = [head_maps(attn, torch.randn(6, 16), layer=i) for i in range(3)]
    sub = [HeadMaps(m.tokens, m.layer, m.weights[[1, 3]], m.writes[[1, 3]], m.value_norms[[1, 3]], heads=(1, 3))
           for m in layers]
    meta, blob = embedded(render_html(sub))
    assert meta["layers"] == [0, 1, 2] and meta["heads"] == [1, 3]
    w, norms = decode(meta, blob)
    torch.testing.assert_close(w, torch.stack([m.weights for m in sub]), atol=STEP + 1e-7, rtol=0)
    torch.testing.assert_close(norms, torch.stack([m.value_norms for m in sub]), atol=0, rtol=0)
    with pytest.raises(ValueError, match="same tokens and the same number of heads"):
        render_html([layers[0], sub[1]])


def test_tokens_cannot_inject_markup() -> None:
    attn = MultiHeadAttention(8, 2)
    tokens = ["</script><b>x</b>", "<img src=x>", "&amp;"]
    page = render_html(head_maps(attn, torch.randn(3, 8), tokens=tokens), title="<i>t</i>")
    assert "<b>x</b>" not in page and "<img" not in page and "<i>t</i>" not in page
    assert embedded(page)[0]["tokens"] == tokens


def test_save_html_checks_suffix(maps: HeadMaps, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"\.html"):
        save_html(maps, tmp_path / "x.png")


def hover_cell(page, kind: str, i: int, j: int) -> dict:
    """Move the real (DevTools) mouse onto cell (i, j) of the open head view; the tooltip's text and data."""
    x, y = page.js(f"headwise.cellCenter({json.dumps(kind)}, {i}, {j})")
    page.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
    return page.js("(function(){var t=document.getElementById('tip');"
                   "return {text: t.textContent, shown: getComputedStyle(t).display, data: Object.assign({}, t.dataset)};})()")


def wait_rendered(page) -> None:
    """Wait for the page's own promise: data decoded and every thumbnail drawn."""
    r = page.call("Runtime.evaluate", expression="headwise.ready.then(function () { return 1; })",
                  awaitPromise=True, returnByValue=True)
    assert r["result"].get("value") == 1, r


def shown_weight(tip: dict) -> float:
    return float(re.search(r"weight (\d+\.\d+)", tip["text"]).group(1))


@pytest.mark.xdist_group("chromium")
def test_chromium_draws_heads_and_the_tooltip_shows_the_value(maps: HeadMaps, chromium, tmp_path) -> None:
    from PIL import Image

    path = save_html(maps, tmp_path / "heads.html")
    page = chromium(path)
    wait_rendered(page)
    assert page.js("document.body.dataset.rendered") == "1"
    assert page.js("document.querySelectorAll('canvas.thumb').length") == maps.n_heads
    # hovering a thumbnail names its head and the weight under the pointer; a real click opens the head view
    page.hover('canvas.thumb[data-h="5"]')
    text = page.js("document.getElementById('tip').textContent")
    assert text.startswith("layer 2, head 5 (click to open)")
    i, j = map(int, re.search(r"query (\d+) .* -> key (\d+)", text).groups())
    assert abs(float(re.search(r"weight (\d+\.\d+)", text).group(1)) - float(maps.weights[5, i, j])) <= STEP + 5e-5
    x, y = page.js("(function(){var r=document.querySelector('canvas.thumb[data-h=\"5\"]').getBoundingClientRect();"
                   "return [r.x + r.width / 2, r.y + r.height / 2];})()")
    for kind in ("mousePressed", "mouseReleased"):
        page.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
    assert page.js("document.getElementById('which').textContent") == "layer 2, head 5"
    assert page.js("document.getElementById('model').hidden") is True
    assert page.js("location.hash") == "#L2H5"
    shot = Image.open(io.BytesIO(page.screenshot())).convert("RGB")
    rgb = np.asarray(shot.resize((200, 150)), dtype=np.int32)
    r, b = rgb[..., 0], rgb[..., 2]
    assert int((b > r + 40).sum()) > 100 and int((r > b + 40).sum()) > 100  # weights (blue) and writes (orange)

    s = len(maps.tokens)
    for i, j in [(8, int(maps.weights[5, 8].argmax())), (3, s - 1)]:
        tip = hover_cell(page, "weights", i, j)
        assert tip["shown"] == "block"
        assert tip["data"] == {"layer": "2", "head": "5", "query": str(i), "key": str(j),
                               "weight": f"{shown_weight(tip):.4f}"}
        assert f"query {i} {json.dumps(maps.tokens[i])} -> key {j} {json.dumps(maps.tokens[j])}" in tip["text"]
        assert abs(shown_weight(tip) - float(maps.weights[5, i, j])) <= STEP + 5e-5  # 4 decimals shown
        writes = float(re.search(r"writes (\S+)", tip["text"]).group(1))
        assert writes == pytest.approx(float(maps.writes[5, i, j]), abs=STEP * float(maps.value_norms[5, j]) + 1e-3)
    page.call("Input.dispatchKeyEvent", type="keyDown", key="ArrowRight", code="ArrowRight", windowsVirtualKeyCode=39)
    assert page.js("document.getElementById('which').textContent") == "layer 2, head 6"
    page.call("Input.dispatchKeyEvent", type="keyDown", key="Escape", code="Escape", windowsVirtualKeyCode=27)
    assert page.js("document.getElementById('headview').hidden") is True


def test_browser_tests_skipped_without_chromium_are_named_at_the_end() -> None:
    from tests.viz import conftest

    class Report:
        def __init__(self, nodeid, reason):
            self.nodeid, self.longrepr = nodeid, ("tests/viz/conftest.py", 160, f"Skipped: {reason}")

    class Reporter:
        def __init__(self, skipped):
            self.stats, self.lines = {"skipped": skipped}, []

        def section(self, title, **kw):
            self.lines.append(f"== {title}")

        def line(self, text, **kw):
            self.lines.append(text)

    quiet = Reporter([Report("tests/x.py::test_other", "needs a GPU")])
    conftest.pytest_terminal_summary(quiet)
    assert quiet.lines == []  # nothing to say when every browser test ran
    told = Reporter([Report("tests/viz/test_html.py::test_chromium_draws", f"{conftest.NO_BROWSER}: not checked")])
    conftest.pytest_terminal_summary(told)
    assert told.lines[0] == "== browser tests skipped"
    assert "1 test(s) need a browser and were skipped: chromium is not installed" in told.lines[1]
    assert "apt-get install chromium" in told.lines[1] and told.lines[2].endswith("test_chromium_draws")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_html_refuses_value_norms_that_are_not_finite(bad: float, tmp_path) -> None:
    attn = MultiHeadAttention(8, 2)
    with torch.no_grad():
        attn.out_proj.weight[0, 0] = bad  # one corrupt W_O entry, in head 0's columns
    m = head_maps(attn, torch.randn(3, 8))
    if bad < 0:  # a negative W_O entry is a valid weight: plant the impossible norm itself
        m.value_norms[0, 1] = bad
    assert bool(torch.isfinite(m.weights).all())  # what the page checked before: the weights are fine
    with pytest.raises(ValueError, match=r"norms .* must be finite and >= 0 to be drawn; layer 0 head\(s\) \[0\]"):
        render_html(m)
    with pytest.raises(ValueError, match="value norms"):
        save_html(m, tmp_path / "nan.html")
    assert not (tmp_path / "nan.html").exists()
    # the page JavaScript reads: every page that is written parses as strict JSON
    ok = head_maps(MultiHeadAttention(8, 2), torch.randn(3, 8))
    meta = re.search(r'<script id="headwise-meta" type="application/json">(.*?)</script>', render_html(ok), re.S)
    json.loads(meta.group(1), parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))


def test_html_refuses_a_layer_without_heads() -> None:
    tokens = [f"t{i}" for i in range(4)]
    empty = HeadMaps(tokens, 3, torch.zeros(0, 4, 4), torch.zeros(0, 4, 4), torch.zeros(0, 4), original_heads=())
    with pytest.raises(ValueError, match="layer 3 has no head to draw: head surgery removed every head"):
        render_html(empty)
    with pytest.raises(ValueError, match="layer 3 has no head to draw"):
        render_html([empty, empty])


@pytest.mark.parametrize("title, error, match", [
    (5, TypeError, "title must be a str, got int 5"),
    ("bad \udcff title", ValueError, r"title must be valid Unicode .* got '\\udcff' at character 4"),
])
def test_a_refused_title_leaves_an_existing_page_as_it_was(tmp_path, title, error, match) -> None:
    m = head_maps(MultiHeadAttention(8, 2), torch.randn(3, 8))
    with pytest.raises(error, match=match):
        render_html(m, title=title)
    path = tmp_path / "old.html"
    path.write_text("PREVIOUS PAGE", encoding="utf-8")
    with pytest.raises(error, match=match):
        save_html(m, path, title=title)
    assert path.read_text(encoding="utf-8") == "PREVIOUS PAGE"


def test_a_page_that_fails_while_being_written_leaves_the_old_file(tmp_path, monkeypatch) -> None:
    from pathlib import Path

    def half_written(self, data):
        with open(self, "wb") as f:
            f.write(data[:10])
        raise OSError(28, "No space left on device")

    path = tmp_path / "old.html"
    path.write_text("PREVIOUS PAGE", encoding="utf-8")
    monkeypatch.setattr(Path, "write_bytes", half_written)
    with pytest.raises(OSError, match="No space left"):
        save_html(head_maps(MultiHeadAttention(8, 2), torch.randn(3, 8)), path)
    assert path.read_text(encoding="utf-8") == "PREVIOUS PAGE"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.html"]  # no scratch file left behind


def test_the_page_labels_axes_with_tokens_cut_to_twelve_characters() -> None:
    tokens = ["L" * 300, "cat", "exactly12chr", "thirteen-char"]
    meta, _ = embedded(render_html(head_maps(MultiHeadAttention(8, 2), torch.randn(4, 8), tokens=tokens)))
    assert meta["tokens"] == tokens  # the tooltips show the whole token
    assert meta["labels"] == ["L" * 11 + "\u2026", "cat", "exactly12chr", "thirteen-ch\u2026"]
