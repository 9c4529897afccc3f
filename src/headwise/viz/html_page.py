"""The page template of :mod:`headwise.viz.html`: markup, CSS and the JavaScript that decodes the embedded
data and draws it on ``<canvas>``. ``$title`` is HTML-escaped text, ``$meta`` script-safe JSON and ``$blob``
base64 (see :mod:`headwise.viz.html` for the encoding).

The page exposes ``window.headwise`` (``ready``: a promise resolved once every thumbnail is drawn,
``open(layer, head)``, ``cellCenter(kind, i, j)`` -> viewport coordinates of a cell of the open head view,
``weight(layerIndex, headIndex, i, j)``) for tests and for scripting the view; ``#L3H5`` in the URL opens
layer 3, head 5.

Shapes:
    L layers, h heads, s tokens: weights (L, h, s, s) uint8, norms (L, h, s) float32
"""

from __future__ import annotations

from string import Template

__all__ = ["PAGE"]

PAGE = Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data: blob:">
<title>$title</title>
<style>
body { font-family: system-ui, sans-serif; margin: 16px; color: #222; background: #fff; }
h1 { font-size: 18px; margin: 0 0 4px 0; }
p.help { font-size: 13px; color: #555; margin: 2px 0 10px 0; max-width: 70em; }
#status { font-size: 13px; color: #a00; }
.layer-row { display: flex; align-items: center; gap: 4px; margin: 2px 0; }
.layer-row .name { width: 64px; font-size: 12px; color: #555; flex: none; }
.head-col { display: flex; gap: 4px; margin-left: 68px; font-size: 11px; color: #777; }
.head-col span { width: 72px; text-align: center; }
canvas.thumb { width: 72px; height: 72px; image-rendering: pixelated; border: 1px solid #ccc; cursor: pointer; }
canvas.thumb:hover { border-color: #000; }
#headview[hidden], #model[hidden] { display: none; }
#controls { margin: 6px 0; font-size: 13px; }
#controls button { margin-right: 4px; }
#maps { display: flex; flex-wrap: wrap; gap: 16px; }
.map .label { font-size: 12px; color: #555; margin-bottom: 2px; }
.map canvas { display: block; cursor: crosshair; image-rendering: pixelated; }
#tip { position: fixed; pointer-events: none; background: rgba(255,255,255,0.96); border: 1px solid #333;
       border-radius: 4px; padding: 4px 6px; font-size: 12px; white-space: pre; display: none; z-index: 10; }
#cell { position: absolute; pointer-events: none; border: 1px solid #000; display: none; }
</style>
</head>
<body>
<h1 id="title">$title</h1>
<p class="help">Model view: one thumbnail per layer (rows) and head (columns), the head's attention weights
(blue, darker = larger; each pixel the largest weight it covers). Colours follow the square root of the value,
so that small weights stay visible; the tooltip gives the value itself. Click a thumbnail to open the head view:
rows are query tokens, columns key tokens; the left map is where the head reads (its weights), the right
one what it writes (orange: weight x ||value W_O||, one scale for every head). Hover for tokens and values;
arrow keys move between heads (left/right) and layers (up/down), Escape goes back; zoom enlarges long inputs.</p>
<div id="status">decoding...</div>
<div id="model"></div>
<div id="headview" hidden>
  <div id="controls"><button id="back">all heads (Esc)</button><button id="prev">previous head</button><button
  id="next">next head</button> <label>zoom <select id="zoom"><option>1</option><option>2</option><option>3</option><option>4</option></select></label>
  <b id="which"></b></div>
  <div id="maps">
    <div class="map"><div class="label">reads: attention weights (rows = query tokens, columns = key tokens)</div><canvas id="map-weights"></canvas></div>
    <div class="map" id="writes"><div class="label">writes: weight x ||value W_O|| (rows = query tokens, columns = key tokens)</div><canvas id="map-writes"></canvas></div>
  </div>
</div>
<div id="tip" role="tooltip"></div>
<div id="cell"></div>
<script id="headwise-meta" type="application/json">$meta</script>
<script id="headwise-data" type="application/octet-stream">$blob</script>
<script>
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("headwise-meta").textContent);
  var S = D.s, L = D.layers.length, H = D.heads.length, STEPS = D.steps;
  var THUMB = 96, CELL_PX = 520, ML = 96, MT = 96;
  var BLUE = [33, 102, 172], ORANGE = [230, 85, 13];
  var W = null, N = null, state = { view: "model", l: 0, h: 0 };
  var tip = document.getElementById("tip"), box = document.getElementById("cell");
  var status = document.getElementById("status");

  function weight(l, h, i, j) { return W[((l * H + h) * S + i) * S + j] / STEPS; }
  function norm(l, h, j) { return N[(l * H + h) * S + j]; }
  function shade(rgb, a, px, o) {
    // square-root colour scale: at hundreds of tokens most weights are small, and linear shades hide them
    a = Math.sqrt(a < 0 ? 0 : (a > 1 ? 1 : a));
    px[o] = 255 - a * (255 - rgb[0]); px[o + 1] = 255 - a * (255 - rgb[1]); px[o + 2] = 255 - a * (255 - rgb[2]);
    px[o + 3] = 255;
  }
  function cellName(l, h) { return "layer " + D.cells[l][h][0] + ", head " + D.cells[l][h][1]; }
  function find(layer, head) {  // the thumbnail of (layer, head number), or null
    for (var l = 0; l < L; l++) for (var h = 0; h < H; h++)
      if (D.cells[l][h][0] === layer && D.cells[l][h][1] === head) return [l, h];
    return null;
  }
  function quote(t) { return JSON.stringify(String(t)); }

  function decode() {
    var bin = atob(document.getElementById("headwise-data").textContent.trim());
    var bytes = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    var stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return new Response(stream).arrayBuffer().then(function (buf) {
      var nw = L * H * S * S;
      W = new Uint8Array(buf, 0, nw);
      N = new Float32Array(buf.slice(nw));
    });
  }

  function showTip(ev, text, data) {
    tip.textContent = text;
    Object.keys(tip.dataset).forEach(function (k) { delete tip.dataset[k]; });
    Object.keys(data).forEach(function (k) { tip.dataset[k] = data[k]; });
    tip.style.display = "block";
    var x = ev.clientX + 14, y = ev.clientY + 14;
    if (x + tip.offsetWidth > window.innerWidth) x = ev.clientX - tip.offsetWidth - 8;
    if (y + tip.offsetHeight > window.innerHeight) y = ev.clientY - tip.offsetHeight - 8;
    tip.style.left = x + "px"; tip.style.top = y + "px";
  }
  function hideTip() { tip.style.display = "none"; box.style.display = "none"; }

  // -- the model view: thumbnails, max-pooled to at most THUMB pixels a side --------------------------------
  var F = Math.max(1, Math.ceil(S / THUMB)), T = Math.ceil(S / F);
  function drawThumb(canvas, l, h) {
    var mx = new Uint8Array(T * T), base = (l * H + h) * S * S;
    for (var i = 0; i < S; i++) {
      var row = base + i * S, ri = ((i / F) | 0) * T;
      for (var j = 0; j < S; j++) {
        var v = W[row + j], k = ri + ((j / F) | 0);
        if (v > mx[k]) mx[k] = v;
      }
    }
    var ctx = canvas.getContext("2d"), img = ctx.createImageData(T, T);
    for (var p = 0; p < T * T; p++) shade(BLUE, mx[p] / STEPS, img.data, 4 * p);
    ctx.putImageData(img, 0, 0);
  }
  function drawModel() {
    var model = document.getElementById("model");
    var cols = document.createElement("div"); cols.className = "head-col";
    D.cols.forEach(function (name) {
      var s = document.createElement("span"); s.textContent = name; cols.appendChild(s);
    });
    model.appendChild(cols);
    for (var l = 0; l < L; l++) {
      var row = document.createElement("div"); row.className = "layer-row";
      var name = document.createElement("span"); name.className = "name"; name.textContent = D.rows[l];
      row.appendChild(name);
      for (var h = 0; h < H; h++) {
        var c = document.createElement("canvas");
        c.className = "thumb head"; c.width = T; c.height = T; c.dataset.l = l; c.dataset.h = h;
        drawThumb(c, l, h);
        c.addEventListener("click", function (ev) { open(+ev.target.dataset.l, +ev.target.dataset.h); });
        c.addEventListener("mousemove", thumbTip);
        c.addEventListener("mouseleave", hideTip);
        row.appendChild(c);
      }
      model.appendChild(row);
    }
  }
  function thumbTip(ev) {
    var c = ev.target, r = c.getBoundingClientRect(), l = +c.dataset.l, h = +c.dataset.h;
    var bi = Math.min(T - 1, Math.floor((ev.clientY - r.top) / r.height * T));
    var bj = Math.min(T - 1, Math.floor((ev.clientX - r.left) / r.width * T));
    var i0 = bi * F, i1 = Math.min(S, i0 + F), j0 = bj * F, j1 = Math.min(S, j0 + F), best = 0;
    for (var i = i0; i < i1; i++) for (var j = j0; j < j1; j++) best = Math.max(best, weight(l, h, i, j));
    var where = F === 1 ? "query " + i0 + " " + quote(D.tokens[i0]) + " -> key " + j0 + " " + quote(D.tokens[j0])
      : "queries " + i0 + "-" + (i1 - 1) + ", keys " + j0 + "-" + (j1 - 1);
    showTip(ev, cellName(l, h) + " (click to open)\\n" + where +
      "\\n" + (F === 1 ? "weight " : "largest weight ") + best.toFixed(4),
      { layer: D.cells[l][h][0], head: D.cells[l][h][1], weight: best.toFixed(4) });
  }

  // -- the head view: weights and writes at one cell per token pair, with axis labels ------------------------
  var C = Math.max(1, Math.floor(CELL_PX / S)), G = C * S, EVERY = Math.max(1, Math.ceil(13 / C));
  function drawMap(canvas, l, h, kind) {
    canvas.width = ML + G + 8; canvas.height = MT + G + 8;
    var ctx = canvas.getContext("2d"), img = ctx.createImageData(G, G), px = img.data;
    var rgb = kind === "weights" ? BLUE : ORANGE, scale = kind === "weights" ? 1 : D.max_write;
    for (var i = 0; i < S; i++) {
      for (var j = 0; j < S; j++) {
        var a = weight(l, h, i, j) * (kind === "weights" ? 1 : norm(l, h, j)) / scale;
        for (var y = 0; y < C; y++) for (var x = 0; x < C; x++) shade(rgb, a, px, 4 * ((i * C + y) * G + j * C + x));
      }
    }
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.putImageData(img, ML, MT);
    ctx.strokeStyle = "#bbb"; ctx.strokeRect(ML - 0.5, MT - 0.5, G + 1, G + 1);
    ctx.fillStyle = "#333"; ctx.font = "11px system-ui, sans-serif";
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    for (var q = 0; q < S; q += EVERY) ctx.fillText(D.labels[q], ML - 4, MT + q * C + C / 2);
    ctx.save(); ctx.translate(ML, MT); ctx.rotate(-Math.PI / 2); ctx.textAlign = "left";
    for (var k = 0; k < S; k += EVERY) ctx.fillText(D.labels[k], 4, k * C + C / 2);
    ctx.restore();
    ctx.fillStyle = "#777"; ctx.textAlign = "left"; ctx.textBaseline = "top";
    ctx.fillText("keys \\u2192", 2, 2);
    ctx.fillText("queries \\u2193", 2, 16);
    if (EVERY > 1) ctx.fillText("labels: every " + EVERY + " tokens", 2, 30);
  }
  function cellOf(canvas, ev) {
    var r = canvas.getBoundingClientRect();
    var x = (ev.clientX - r.left) * canvas.width / r.width - ML, y = (ev.clientY - r.top) * canvas.height / r.height - MT;
    var i = Math.floor(y / C), j = Math.floor(x / C);
    return i >= 0 && j >= 0 && i < S && j < S ? [i, j] : null;
  }
  function mapTip(ev) {
    var canvas = ev.currentTarget, cell = cellOf(canvas, ev), l = state.l, h = state.h;
    if (!cell) { hideTip(); return; }
    var i = cell[0], j = cell[1], w = weight(l, h, i, j), n = norm(l, h, j);
    showTip(ev, "query " + i + " " + quote(D.tokens[i]) + " -> key " + j + " " + quote(D.tokens[j]) +
      "\\nweight " + w.toFixed(4) + " (stored to +-" + (0.5 / STEPS).toFixed(4) + ")" +
      (D.writes_missing ? "" : "\\n||v W_O|| " + n.toPrecision(4) + ", writes " + (w * n).toPrecision(4)) +
      "\\n" + cellName(l, h),
      { layer: D.cells[l][h][0], head: D.cells[l][h][1], query: i, key: j, weight: w.toFixed(4) });
    var r = canvas.getBoundingClientRect(), k = r.width / canvas.width;
    if (C * k >= 4) {
      box.style.display = "block";
      box.style.left = (window.scrollX + r.left + (ML + j * C) * k - 1) + "px";
      box.style.top = (window.scrollY + r.top + (MT + i * C) * k - 1) + "px";
      box.style.width = box.style.height = (C * k) + "px";
    } else { box.style.display = "none"; }
  }
  function open(l, h) {
    l = (l + L) % L; h = (h + H) % H;
    state = { view: "head", l: l, h: h };
    document.getElementById("model").hidden = true;
    document.getElementById("headview").hidden = false;
    document.getElementById("which").textContent = cellName(l, h);
    drawMap(document.getElementById("map-weights"), l, h, "weights");
    if (D.writes_missing) {  // W_O not located: the reads alone, and why
      document.getElementById("writes").firstChild.textContent = "writes not drawn: " + D.writes_missing;
      document.getElementById("map-writes").hidden = true;
    } else {
      drawMap(document.getElementById("map-writes"), l, h, "writes");
    }
    zoom();
    hideTip();
    var hash = "#L" + D.cells[l][h][0] + "H" + D.cells[l][h][1];
    if (location.hash !== hash) history.replaceState(null, "", hash);
  }
  function zoom() {  // CSS scaling only: the tooltip maps the pointer back through the canvas's on-screen size
    var z = +document.getElementById("zoom").value;
    ["map-weights", "map-writes"].forEach(function (id) {
      var c = document.getElementById(id);
      c.style.width = (c.width * z) + "px"; c.style.height = (c.height * z) + "px";
    });
  }
  function back() {
    state.view = "model"; hideTip();
    document.getElementById("headview").hidden = true;
    document.getElementById("model").hidden = false;
    if (location.hash) history.replaceState(null, "", location.pathname + location.search);
  }
  function fromHash() {
    var m = /^#L(\\d+)H(\\d+)$$/.exec(location.hash);
    if (!m) return;
    var at = find(+m[1], +m[2]);
    if (at) open(at[0], at[1]);
  }
  ["map-weights", "map-writes"].forEach(function (id) {
    var c = document.getElementById(id);
    c.addEventListener("mousemove", mapTip);
    c.addEventListener("mouseleave", hideTip);
  });
  document.getElementById("back").addEventListener("click", back);
  document.getElementById("zoom").addEventListener("change", zoom);
  document.getElementById("prev").addEventListener("click", function () { open(state.l, state.h - 1); });
  document.getElementById("next").addEventListener("click", function () { open(state.l, state.h + 1); });
  document.addEventListener("keydown", function (ev) {
    if (state.view !== "head") return;
    var moves = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] };
    if (ev.key === "Escape") back();
    else if (moves[ev.key]) { open(state.l + moves[ev.key][0], state.h + moves[ev.key][1]); ev.preventDefault(); }
  });
  window.addEventListener("hashchange", fromHash);

  var ready = (typeof DecompressionStream === "undefined"
    ? Promise.reject(new Error("this browser cannot decompress the data (DecompressionStream is missing)"))
    : decode()).then(function () {
      drawModel();
      status.textContent = "";
      document.body.dataset.rendered = "1";
      document.body.dataset.renderMs = String(Math.round(performance.now()));
      fromHash();
    }, function (err) { status.textContent = "cannot show the heads: " + err.message; throw err; });

  window.headwise = {
    ready: ready,
    open: function (layer, head) { var at = find(layer, head); if (at) open(at[0], at[1]); },
    weight: function (l, h, i, j) { return weight(l, h, i, j); },
    cellCenter: function (kind, i, j) {
      var c = document.getElementById("map-" + kind), r0 = c.getBoundingClientRect(), k = r0.width / c.width;
      window.scrollTo(window.scrollX + r0.left + (ML + j * C) * k - 200, window.scrollY + r0.top + (MT + i * C) * k - 200);
      var r = c.getBoundingClientRect();
      return [r.left + (ML + (j + 0.5) * C) * k, r.top + (MT + (i + 0.5) * C) * k];
    }
  };
})();
</script>
</body>
</html>
""")
