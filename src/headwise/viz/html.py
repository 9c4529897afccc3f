"""A self-contained HTML page of every head of a layer: hover a token to see where each head reads from
and what it writes. Data, CSS and JavaScript are inline; the page loads nothing from the network.

Shapes:
    s: tokens, h: heads; the page embeds weights and writes as (h, s, s) nested lists.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from string import Template

from .maps import HeadMaps

__all__ = ["render_html", "save_html"]

_PAGE = Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<title>$title</title>
<style>
body { font-family: system-ui, sans-serif; margin: 16px; color: #222; background: #fff; }
h1 { font-size: 18px; margin: 0 0 4px 0; }
p.help { font-size: 13px; color: #555; margin: 2px 0 10px 0; }
#sentence { font-size: 16px; margin: 8px 0 14px 0; line-height: 2; }
.tok { padding: 2px 4px; margin: 1px; border: 1px solid #bbb; border-radius: 4px; cursor: pointer; }
.tok.active { background: #222; color: #fff; }
#heads { display: grid; grid-template-columns: repeat(auto-fill, minmax(330px, 1fr)); gap: 10px; }
.head { border: 1px solid #ddd; border-radius: 6px; padding: 6px; }
.head h3 { font-size: 13px; margin: 0 0 4px 0; }
.maps { display: flex; gap: 6px; }
.map { flex: 1; }
.map .label { font-size: 11px; color: #555; }
.map svg { width: 100%; height: auto; display: block; border: 1px solid #eee; }
.rowmark { fill: none; stroke: #000; stroke-width: 0.12; visibility: hidden; }
.srcs { font-size: 11px; line-height: 1.9; margin-top: 3px; }
.src { padding: 1px 3px; margin: 0 1px; border-radius: 3px; }
</style>
</head>
<body>
<h1>$title</h1>
<p class="help">Hover a token: in every head, the source tokens light up by how much the hovered token reads
from them (blue: attention weight) and how much that reading actually writes into the output (orange:
weight x ||value W_O||, one scale for all heads). Without a token selected, the mean over all query tokens is shown.
In the maps, rows are query tokens and columns source tokens.</p>
<div id="sentence"></div>
<div id="heads"></div>
<script id="headwise-data" type="application/json">$data</script>
<script>
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("headwise-data").textContent);
  var S = D.tokens.length, H = D.weights.length;
  var maxWrite = 0;
  D.writes.forEach(function (m) { m.forEach(function (r) { r.forEach(function (v) { if (v > maxWrite) maxWrite = v; }); }); });
  if (maxWrite <= 0) maxWrite = 1;
  var KINDS = [
    { key: "weights", name: "reads (weights)", rgb: "33,102,172", scale: 1 },
    { key: "writes", name: "writes ||a v W_O||", rgb: "230,85,13", scale: maxWrite }
  ];
  var SVGNS = "http://www.w3.org/2000/svg";
  var sentence = document.getElementById("sentence");
  D.tokens.forEach(function (t, i) {
    var span = document.createElement("span");
    span.className = "tok"; span.textContent = t; span.dataset.i = i;
    span.addEventListener("mouseenter", function () { select(i); });
    sentence.appendChild(span);
    sentence.appendChild(document.createTextNode(" "));
  });
  sentence.addEventListener("mouseleave", function () { select(null); });
  var grid = document.getElementById("heads");
  for (var h = 0; h < H; h++) {
    var box = document.createElement("div");
    box.className = "head"; box.dataset.h = h;
    var title = document.createElement("h3");
    title.textContent = "head " + h;
    box.appendChild(title);
    var maps = document.createElement("div"); maps.className = "maps";
    KINDS.forEach(function (k) {
      var col = document.createElement("div"); col.className = "map " + k.key;
      var label = document.createElement("div"); label.className = "label"; label.textContent = k.name;
      col.appendChild(label);
      var svg = document.createElementNS(SVGNS, "svg");
      svg.setAttribute("viewBox", "0 0 " + S + " " + S);
      var m = D[k.key][h];
      for (var i = 0; i < S; i++) {
        for (var j = 0; j < S; j++) {
          var r = document.createElementNS(SVGNS, "rect");
          r.setAttribute("x", j); r.setAttribute("y", i); r.setAttribute("width", 1); r.setAttribute("height", 1);
          r.setAttribute("fill", "rgba(" + k.rgb + "," + Math.min(1, m[i][j] / k.scale).toFixed(4) + ")");
          r.dataset.i = i;
          r.addEventListener("mouseenter", (function (row) { return function () { select(row); }; })(i));
          svg.appendChild(r);
        }
      }
      var mark = document.createElementNS(SVGNS, "rect");
      mark.setAttribute("class", "rowmark"); mark.setAttribute("x", 0); mark.setAttribute("width", S);
      mark.setAttribute("height", 1); mark.setAttribute("y", 0);
      svg.appendChild(mark);
      col.appendChild(svg);
      var srcs = document.createElement("div"); srcs.className = "srcs";
      D.tokens.forEach(function (t, j) {
        var sp = document.createElement("span");
        sp.className = "src"; sp.textContent = t; sp.dataset.j = j; sp.dataset.kind = k.key;
        srcs.appendChild(sp); srcs.appendChild(document.createTextNode(" "));
      });
      col.appendChild(srcs);
      maps.appendChild(col);
    });
    box.appendChild(maps);
    grid.appendChild(box);
  }
  function value(key, h, i, j) {
    if (i !== null) return D[key][h][i][j];
    var sum = 0;
    for (var q = 0; q < S; q++) sum += D[key][h][q][j];
    return sum / S;
  }
  function select(i) {
    document.querySelectorAll(".tok").forEach(function (el) {
      el.classList.toggle("active", i !== null && Number(el.dataset.i) === i);
    });
    document.querySelectorAll(".head").forEach(function (box) {
      var h = Number(box.dataset.h);
      KINDS.forEach(function (k) {
        var col = box.querySelector(".map." + k.key);
        var mark = col.querySelector(".rowmark");
        mark.style.visibility = i === null ? "hidden" : "visible";
        if (i !== null) mark.setAttribute("y", i);
        col.querySelectorAll(".src").forEach(function (sp) {
          var v = value(k.key, h, i, Number(sp.dataset.j));
          sp.dataset.value = v;
          sp.style.backgroundColor = "rgba(" + k.rgb + "," + Math.min(1, v / k.scale).toFixed(4) + ")";
        });
      });
    });
    document.body.dataset.selected = i === null ? "" : String(i);
  }
  window.headwiseSelect = select;
  select(null);
})();
</script>
</body>
</html>
""")


def render_html(maps: HeadMaps, *, title: str | None = None) -> str:
    """The page as a string: one panel per head (weights and writes maps, source tokens that light up on
    hover). No external resource is referenced; a Content-Security-Policy forbids any network access.

    Shapes:
        maps.weights, maps.writes: (h, s, s)

    Example:
        >>> import torch
        >>> from headwise import MultiHeadAttention
        >>> from headwise.viz.maps import head_maps
        >>> page = render_html(head_maps(MultiHeadAttention(8, 2), torch.randn(3, 8), tokens=["a", "<b>", "c"]))
        >>> "http" in page.replace("http-equiv", "").replace("http://www.w3.org/2000/svg", ""), "<b>" in page
        (False, False)
    """
    payload = maps.to_dict()
    # JSON inside <script>: escape "<" so that no token can close the script element or open a tag.
    data = json.dumps(payload, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e")
    title = title or f"headwise: the {maps.n_heads} heads of layer {maps.layer}"
    return _PAGE.substitute(title=html.escape(title), data=data)


def save_html(maps: HeadMaps, path: str | Path, *, title: str | None = None) -> Path:
    """Write :func:`render_html` to ``path`` (UTF-8).

    Shapes:
        maps.weights, maps.writes: (h, s, s)
    """
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"save_html writes a .html file, got {str(path)!r}")
    path.write_text(render_html(maps, title=title), encoding="utf-8")
    return path
