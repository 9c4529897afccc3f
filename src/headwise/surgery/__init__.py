"""Head surgery: score heads, remove them, and regroup K/V heads, on headwise layers and patched models.

* :func:`gradient_importance` / :func:`ablation_importance`: per-head scores, (layers, heads).
* :func:`prune_heads`: physically remove heads (exactly the zero-ablated layer).
* :func:`to_gqa` / :func:`to_mha`: mean-pool K/V heads into groups (Ainslie et al., 2023), and back (exact).
* :func:`save_pretrained` / :func:`load_pretrained`: a changed Hugging Face model to a folder and back.
* :func:`original_heads`: per layer, the original index of every head that surgery left.
"""

from __future__ import annotations

from .importance import ablation_importance, gradient_importance
from .io import load_pretrained, save_pretrained, shape_mismatch
from .origin import original_heads
from .prune import prune_heads
from .regroup import similarity_groups, to_gqa, to_mha

__all__ = ["gradient_importance", "ablation_importance", "prune_heads", "to_gqa", "to_mha", "similarity_groups",
           "save_pretrained", "load_pretrained", "original_heads", "shape_mismatch"]
