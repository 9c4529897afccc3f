"""Hugging Face interop: take over the attention of transformers models, and give it back.

* :func:`patch` / :func:`unpatch` / :func:`layers` (:mod:`.patch`): every attention module that calls
  transformers' attention interface computes its heads with headwise, in place, and gets a headwise layer
  (``module.attn``, a live view of its weights: :mod:`.layer`); nothing of the model or of transformers is
  replaced.
* :func:`from_hf` / :func:`to_hf` (:mod:`.convert`): one module <-> one standalone
  :class:`~headwise.MultiHeadAttention`, weights exact.
* ``attn_implementation="headwise"`` (:mod:`.attention_function`): registered with transformers when
  :mod:`headwise.interop` is imported.
* :mod:`.registry`: where each family keeps its projections and what it adds (rotary, QK-norm), the one place a
  family is recognised; :mod:`.locate` reads a module with it; :mod:`.surgery` resizes a module in place;
  :mod:`.latent` gives multi-head latent attention's heads; :mod:`.qk_norm` per-head Q/K norms; :mod:`.rope` the
  model's rotary as headwise's.

Needs the optional ``transformers`` package (``pip install 'headwise[hf]'``).
"""

from __future__ import annotations

from .attention_function import NAME, register
from .convert import from_hf, to_hf
from .layer import HFView
from .patch import layers, patch, unpatch

__all__ = ["patch", "unpatch", "layers", "from_hf", "to_hf", "register", "NAME", "HFView"]
