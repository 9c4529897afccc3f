"""W_O as a layer's forward applies it, for what each head writes (:mod:`headwise.viz.maps`).

A projection wrapped by an adapter (PEFT's LoRA and the like: a module holding a ``base_layer``) still shows its
base weight as ``.weight``, while its forward adds the adapter's update. Pairing the forward's values with that
base weight would draw writes of neither the adapted nor the base model, so the weight of a wrapped W_O is read
from the forward itself: the projection of the unit vectors minus the projection of zero (its bias), which is
the merged weight (``merge_and_unload``) for any adapter linear in its input, without changing the model.

Shapes:
    d: model width, h: heads, d_h: head width. W_O: (d, h * d_h).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["output_weight"]


def output_weight(attn: Any) -> torch.Tensor:
    """``attn``'s W_O, detached, as its forward applies it: ``out_proj.weight``, or for a W_O an adapter wraps,
    the weight with the adapter's update merged (read in eval mode: no adapter dropout). ValueError where W_O
    is not located (:func:`headwise.interop.hf.locate` says why).

    Shapes:
        -> (d, h * d_h)

    Example:
        >>> from headwise import MultiHeadAttention
        >>> attn = MultiHeadAttention(8, 2)
        >>> output_weight(attn).shape, output_weight(attn).data_ptr() == attn.out_proj.weight.data_ptr()
        (torch.Size([8, 8]), True)
    """
    from ..tracing.inputs import eval_mode
    from ..tracing.layers import w_o_adapter

    w_o = attn.out_proj.weight.detach()  # (d, h * d_h); ValueError where it is not located
    wrapper = w_o_adapter(attn)
    if wrapper is None:
        return w_o
    n = w_o.shape[1]
    probe = torch.cat([torch.eye(n, dtype=w_o.dtype, device=w_o.device), w_o.new_zeros(1, n)])  # (n + 1, n)
    with torch.no_grad(), eval_mode(wrapper):
        out = attn.out_proj(probe)  # (n + 1, d): row i is W_O e_i + b, the last row b
    return (out[:-1] - out[-1:]).T.detach()
