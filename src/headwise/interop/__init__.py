"""Conversions between headwise and other attention implementations, one file per source format.

* :mod:`headwise.interop.torch_mha`: ``torch.nn.MultiheadAttention`` (``from_torch`` / ``to_torch``; ``share=True``
  for a view of the module's own parameters).
* :mod:`headwise.interop.hf`: Hugging Face attention (``patch`` / ``unpatch`` / ``from_hf`` / ``to_hf`` /
  ``layers``): adapters for BERT, GPT-2, Llama/Mistral/Qwen2/Qwen3, and every other module on transformers'
  attention interface (:mod:`headwise.interop.hf_generic`, located by :mod:`headwise.interop.hf_registry`);
  needs the optional ``transformers`` package.
* :mod:`headwise.interop.qk_norm`: per-head Q/K normalisation (Qwen3's QK-norm) for layers and heads.
* :mod:`headwise.interop.hf_latent`: heads of multi-head latent attention (DeepSeek-V2/V3), whose Q/K/V read shared
  latents (:class:`~headwise.interop.hf_latent.LatentHead`).
* :mod:`headwise.interop.hf_interface`: headwise as a transformers attention implementation,
  ``attn_implementation="headwise"``.

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
    "register": "hf_interface",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'headwise.interop' has no attribute {name!r}")


if importlib.util.find_spec("transformers") is not None:
    importlib.import_module(".hf_interface", __name__).register()
