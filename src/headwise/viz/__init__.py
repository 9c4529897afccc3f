"""Per-head pictures of a real model: where each head reads (its attention weights) and what it writes.

* :mod:`headwise.viz.maps`: the numbers: :func:`head_maps` for any :class:`~headwise.MultiHeadAttention`,
  :func:`model_head_maps` for any layer of a (patched) model's own forward, :func:`text_head_maps` for a text
  through the bundled all-MiniLM-L6-v2, :func:`model_layers_head_maps` for several (or every) layer from one
  forward; :func:`head_gallery` for chosen (layer, head) pairs side by side; all captured with
  :func:`headwise.trace`, in eval mode, tokens labelled from the tokenizer or the token ids.
* :mod:`headwise.viz.projection`: W_O as a layer's forward applies it (an adapter's update merged), for the
  writes.
* :mod:`headwise.viz.positions`: what each head does by position (previous / same / next / first token,
  separators).
* :mod:`headwise.viz.models`: which checkpoint ``headwise heads`` draws and its limits, read from its
  ``config.json`` without loading it (:func:`model_info`).
* :mod:`headwise.viz.png`: one layer's heads as a grid, or every layer x head (needs ``matplotlib``).
* :mod:`headwise.viz.html`: a self-contained HTML model view (every layer x head on canvas, opening into a
  head view with tooltips; inline data, CSS and JS, no network).
* :mod:`headwise.viz.statistics`: every head at long context from per-head statistics, no pattern
  (:func:`model_statistics`), drawn by :mod:`headwise.viz.stats_png` and :mod:`headwise.viz.stats_html`.

Names resolve on first use, so ``import headwise.viz`` imports neither transformers nor matplotlib.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HeadMaps": "maps",
    "head_maps": "maps",
    "model_head_maps": "maps",
    "text_head_maps": "maps",
    "check_max_tokens": "maps",
    "load_minilm": "maps",
    "minilm_path": "maps",
    "model_layers": "maps",
    "model_layers_head_maps": "maps",
    "head_gallery": "maps",
    "positional_scores": "positions",
    "model_info": "models",
    "save_png": "png",
    "render_html": "html",
    "save_html": "html",
    "HeadStatistics": "statistics",
    "model_statistics": "statistics",
    "save_statistics_png": "stats_png",
    "render_statistics_html": "stats_html",
    "save_statistics_html": "stats_html",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'headwise.viz' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)  # the public names (they load on first use), not this module's own imports
