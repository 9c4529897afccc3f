"""Every head of a real model, captured and edited inside its own forward: ``headwise.trace``.

``with headwise.trace(model, capture=("z", "result"), edit={(3, 5): "zero"}) as t: model(x)`` runs the
model's own forward (its masks, norms, rotary, cache) while every :class:`~headwise.MultiHeadAttention` in it
reports its heads through the layer's tracer seam (``MultiHeadAttention.tracer``): ``edit`` rewrites chosen
heads' queries, keys, values, probabilities or contexts, and what ``capture`` names is kept per layer. Edits
never touch a weight and end with the ``with`` block. Traces nest: an inner trace's edits apply after the
outer one's, and each captures what it asked for.

What can be captured (per call of the layer; ``t[i].calls`` keeps every call, e.g. each decoding step). Each
capture is the tensor the forward used, after every edit, so with autograd on it has a gradient:

* ``"q"`` (b, h, s_q, d_h) after rotary; ``"k"``, ``"v"`` (b, h_kv, s, d_h): in a bare layer's forward the
  call's new keys/values (before any cache write); in a patched Hugging Face module what the call attends
  over (HF's cache included).
* ``"pattern"`` (b, h, s_q, s_kv): every head's probabilities. Only this capture (and a pattern edit)
  materialises them: those layers run the eager path (``Trace.materializes_probabilities`` names them).
* ``"z"`` (b, s_q, h, d_h): each head's context (what W_O reads).
* ``"result"`` (b, s_q, h, d): each head's write through W_O, ``z_h @ W_O^h``, one batched GEMM over the
  heads; a bare layer's output is then their sum plus W_O's bias (no second W_O product). Most models add it
  to the residual stream as it is; those that normalise the attention output first (Gemma2, Gemma3, OLMo2)
  add that norm's output.
  Refused while an adapter (PEFT) wraps W_O, whose delta its weight lacks.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width (d_model), d_h: head width (d_head).

Example:
    >>> import torch, headwise
    >>> attn = headwise.MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2)
    >>> x = torch.randn(2, 5, 16)
    >>> with headwise.trace(attn, capture=("z", "result"), edit={(0, 1): "zero"}) as t:
    ...     y = attn(x)
    >>> t[0].z.shape, t[0].result.shape, bool(t[0].z[:, :, 1].eq(0).all())
    (torch.Size([2, 5, 4, 4]), torch.Size([2, 5, 4, 16]), True)
    >>> torch.testing.assert_close(t[0].result.sum(2) + attn.out_proj.bias, y)
    >>> attn.tracer is None                                  # the edit ended with the block
    True
"""

from __future__ import annotations

from .edits import SITES
from .layers import find_layers, head_results
from .record import CAPTURABLE, LayerRecord
from .session import Trace, trace

__all__ = ["trace", "Trace", "LayerRecord", "find_layers", "head_results", "CAPTURABLE", "SITES"]
