"""W_O (or any projection) as a layer's forward applies it, for what each head writes (:mod:`headwise.viz.maps`).

A projection wrapped by an adapter (PEFT's LoRA and the like: a module holding a ``base_layer``) still shows its
base weight as ``.weight``, while its forward adds the adapter's update. Pairing the forward's values with that
base weight would draw writes of neither the adapted nor the base model, so the weight of a wrapped W_O is read
from the forward itself: the projection of the unit vectors minus the projection of zero (its bias), which is
the merged weight (``merge_and_unload``) for any adapter linear in its input, without changing the model
(:func:`applied_weight`, also what :func:`headwise.patching.logit_direction` reads an unembedding with).

Shapes:
    d: model width, h: heads, d_h: head width. W_O: (d, h * d_h). A projection's weight: (out, n).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = ["output_weight", "applied_weight"]

# Unit vectors probed per forward when only some rows are kept: a (chunk, out) output at a time, not (n, out)
# (n = 4096 probes of a 128k-token unembedding would be 2 GiB at once).
_CHUNK = 256


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
    from ..tracing.layers import w_o_adapter

    w_o = attn.out_proj.weight.detach()  # (d, h * d_h); ValueError where it is not located
    wrapper = w_o_adapter(attn)
    if wrapper is None:
        return w_o
    return applied_weight(attn.out_proj, w_o, wrapper)


def applied_weight(project: Callable[[torch.Tensor], torch.Tensor], weight: torch.Tensor, adapter: nn.Module,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weight ``project`` applies, read from its forward: ``project(e_i) - project(0)`` for each unit vector
    ``e_i`` (its bias taken out), which for a projection linear in its input (an adapter's included) is the
    merged weight. Read with ``adapter`` in eval mode (no adapter dropout), its modes given back; detached. A few
    ``rows`` of a wide projection (an unembedding's two tokens) are its input gradients instead, one backward per
    row: the forward on all ``n`` unit vectors would cost ``n`` times the whole projection.

    Args:
        project: the projection, called on (m, n) inputs.
        weight: the weight it stores (out, n) (an adapter's base weight): gives n, dtype and device.
        adapter: the module wrapping the projection, put in eval mode while it is read.
        rows: output rows to keep (1-D indices), or None for all; probed a chunk of unit vectors at a time.

    Shapes:
        weight (out, n) -> (out, n), or (len(rows), n) with ``rows``

    Example:
        >>> lin = torch.nn.Linear(3, 4)
        >>> torch.testing.assert_close(applied_weight(lin, lin.weight, lin, rows=torch.tensor([2, 0])),
        ...                            lin.weight.detach()[[2, 0]])
    """
    from ..tracing.inputs import eval_mode

    n = weight.shape[1]
    with torch.no_grad(), eval_mode(adapter):
        eye = lambda: torch.eye(n, dtype=weight.dtype, device=weight.device)  # noqa: E731 - (n, n), where needed
        if rows is None:
            out = project(torch.cat([eye(), weight.new_zeros(1, n)]))  # (n + 1, out): row i is W e_i + b, then b
            return (out[:-1] - out[-1:]).T.detach()
        if rows.dim() == 1 and 0 < len(rows) and len(rows) * _CHUNK < n and not torch.is_inference_mode_enabled():
            # a few rows: d y_r / d x of a linear map is its row r, one backward each
            with torch.enable_grad():
                x = weight.new_zeros(1, n, requires_grad=True)
                y = project(x)[0, rows]  # (k,)
                if y.grad_fn is not None:  # else a forward autograd cannot see through: the unit vectors below
                    got = [torch.autograd.grad(y[j], x, retain_graph=j + 1 < len(rows))[0][0]
                           for j in range(len(rows))]
                    return torch.stack(got).detach()  # (k, n)
        bias = project(weight.new_zeros(1, n))[:, rows]  # (1, k)
        units = eye()
        parts = [project(units[i:i + _CHUNK])[:, rows] - bias for i in range(0, n, _CHUNK)]  # each (chunk, k)
        return torch.cat(parts).T.detach()  # (k, n)
