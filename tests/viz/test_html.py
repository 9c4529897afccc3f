"""The HTML page: self-contained, carries the right data, and, in headless Chromium, shows every head and
reacts to hovering a token."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
import torch

from headwise import MultiHeadAttention
from headwise.viz.html import render_html, save_html
from headwise.viz.maps import HeadMaps, head_maps


def _embedded(page: str) -> dict:
    m = re.search(r'<script id="headwise-data" type="application/json">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


def test_page_is_self_contained_and_carries_the_data(maps: HeadMaps) -> None:
    page = render_html(maps)
    assert _embedded(page) == maps.to_dict()
    # no network: no external URL anywhere (the SVG namespace is an identifier, never fetched), no src/href
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", page)) - {"http://www.w3.org/2000/svg"}
    assert not urls
    assert not re.search(r"\s(src|href)\s*=", page)
    assert "default-src 'none'" in page  # the CSP forbids loading anything


def test_tokens_cannot_inject_markup() -> None:
    attn = MultiHeadAttention(8, 2)
    tokens = ["</script><b>x</b>", "<img src=x>", "&amp;"]
    page = render_html(head_maps(attn, torch.randn(3, 8), tokens=tokens))
    assert "<b>x</b>" not in page and "<img" not in page
    assert _embedded(page)["tokens"] == tokens


def test_save_html_checks_suffix(maps: HeadMaps, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"\.html"):
        save_html(maps, tmp_path / "x.png")


@pytest.mark.xdist_group("chromium")
def test_chromium_shows_heads_and_hover_changes_highlight(maps: HeadMaps, chromium, tmp_path) -> None:
    from PIL import Image

    path = save_html(maps, tmp_path / "heads.html")
    page = chromium(path)
    assert page.js("document.querySelectorAll('.head').length") == maps.n_heads
    assert page.js("document.querySelectorAll('.head rect:not(.rowmark)').length") == 2 * maps.n_heads * len(
        maps.tokens) ** 2

    shot = page.screenshot()
    (tmp_path / "screenshot.png").write_bytes(shot)
    img = Image.open(io.BytesIO(shot)).convert("RGB")
    assert img.size[0] >= 800 and img.size[1] >= 600
    small = img.resize((200, 150))
    colours = small.getcolors(200 * 150)
    assert len(colours) > 100  # not blank: heat maps in many shades
    rgb = np.asarray(small, dtype=np.int32)
    r, b = rgb[..., 0], rgb[..., 2]
    blue, orange = int((b > r + 40).sum()), int((r > b + 40).sum())
    assert blue > 100 and orange > 100  # both the weights (blue) and the writes (orange) maps are drawn

    def spans(kind: str, head: int) -> list[tuple[float, str]]:
        return page.js(f"Array.from(document.querySelectorAll('.head[data-h=\"{head}\"] .src[data-kind=\"{kind}\"]'))"
                       f".map(function(e){{return [Number(e.dataset.value), e.style.backgroundColor];}})")

    data = maps.to_dict()
    s = len(maps.tokens)
    before = spans("weights", 0)
    mean = [sum(data["weights"][0][i][j] for i in range(s)) / s for j in range(s)]
    assert [v for v, _ in before] == pytest.approx(mean, rel=1e-6)
    assert page.js("document.body.dataset.selected") == ""

    query = 8  # "it"
    page.hover(f'.tok[data-i="{query}"]')
    assert page.js("document.body.dataset.selected") == str(query)
    assert page.js(f"document.querySelector('.tok[data-i=\"{query}\"]').classList.contains('active')")
    for head in (0, 5):
        after_w, after_o = spans("weights", head), spans("writes", head)
        assert [v for v, _ in after_w] == pytest.approx(data["weights"][head][query], rel=1e-6)
        assert [v for v, _ in after_o] == pytest.approx(data["writes"][head][query], rel=1e-6)
    after = spans("weights", 0)
    assert [c for _, c in after] != [c for _, c in before]  # what is highlighted changed
    assert page.js("getComputedStyle(document.querySelector('.rowmark')).visibility") == "visible"
    # the highlighted source is where head 1 reads most for "it"
    bright = max(range(s), key=lambda j: spans("weights", 1)[j][0])
    assert bright == max(range(s), key=lambda j: data["weights"][1][query][j])

    page.hover("h1")  # leave the sentence: back to the mean over queries
    assert page.js("document.body.dataset.selected") == ""
