"""headwise's layer inside other attention code: the ``nn.MultiheadAttention`` converter and the Hugging Face
package.

* :mod:`headwise.interop.torch_mha`: ``torch.nn.MultiheadAttention`` (``from_torch`` / ``to_torch``; ``share=True``
  for a view of the module's own parameters).
* :mod:`headwise.interop.hf`: Hugging Face ``transformers`` (``patch`` / ``unpatch`` / ``layers`` / ``from_hf`` /
  ``to_hf``, and ``attn_implementation="headwise"``); needs the optional ``transformers`` package.
* :mod:`headwise.interop.views`: a :class:`~headwise.MultiHeadAttention` that owns nothing, a live view of another
  module's projections (what both give when they share weights).

Importing this package registers ``"headwise"`` with transformers' ``AttentionInterface`` (and its mask function
with ``AttentionMaskInterface``) when transformers is installed; ``import headwise`` alone never imports it.
Everything else is resolved on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

_EXPORTS = {
    "from_torch": "torch_mha",
    "to_torch": "torch_mha",
    "torch_masks_to_headwise": "torch_mha",
    "patch": "hf",
    "unpatch": "hf",
    "from_hf": "hf",
    "to_hf": "hf",
    "layers": "hf",
    "register": "hf",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'headwise.interop' has no attribute {name!r}")


if importlib.util.find_spec("transformers") is not None:
    importlib.import_module(".hf.attention_function", __name__).register()
