"""The packed projections: W_Q, W_K, W_V as column blocks of one (d_model, h * d_h + 2 * h_kv * d_h) matrix.

The seeds' layout, in memory: every projection weight is an ordinary ``nn.Linear`` parameter of shape
``(d_out, d_in)`` (state dict, ``F.linear``, optimizers and head views unchanged), but its storage is the
``(d_in, d_out)`` row-major matrix of ``q = x @ W_Q``, and the three of a self-attention layer are blocks of
one such matrix. A one-row product (decoding) streams ``(d_in, d_out)`` storage faster on CPU than the
transposed layout, and one product over the packed matrix costs less than three over its blocks; without
autograd the layer runs that one product (:func:`packed_weight`, :func:`packed_product`). Anything that
breaks the packing (a ``.to()`` that converts each parameter, weights replaced or taken apart, hooks on a
projection, a projection swapped for another module) only turns the one product back into three.

Shapes:
    d_in: input width (d_model), d_out: a projection's width; total = sum of the widths packed together.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import buffers
from .buffers import fresh_empty, scratch_empty

__all__ = ["PackedLayout", "PackedWeight", "packed_linears", "packed_product", "packed_weight", "plain_linear",
           "repack"]


def packed_linears(d_in: int, widths: Sequence[int], bias: bool, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> list[nn.Linear]:
    """``nn.Linear(d_in, width)`` for each width, initialised as ``nn.Linear`` does, whose weights are column
    blocks of one ``(d_in, sum(widths))`` row-major matrix (and biases blocks of one vector).

    Shapes:
        each weight: (width, d_in), a transposed view of columns of (d_in, total)

    Example:
        >>> q, k = packed_linears(8, [8, 4], bias=True)
        >>> q.weight.shape, k.weight.shape, k.weight.stride()
        (torch.Size([8, 8]), torch.Size([4, 8]), (1, 12))
        >>> packed_weight([q, k])[0].shape
        torch.Size([8, 12])
    """
    linears = [nn.Linear(d_in, w, bias=bias, device=device, dtype=dtype) for w in widths]
    total = sum(widths)
    # Every decode step streams the whole matrix: a large one goes on huge pages (headwise.buffers).
    weight = fresh_empty((d_in, total), linears[0].weight.dtype, linears[0].weight.device)  # (d_in, total)
    biases = torch.empty(total, device=weight.device, dtype=weight.dtype) if bias else None
    start = 0
    for linear, width in zip(linears, widths):
        block = weight[:, start:start + width]  # (d_in, width)
        block.copy_(linear.weight.detach().t())
        linear.weight = nn.Parameter(block.t())  # (width, d_in), strides (1, total)
        if biases is not None:
            biases[start:start + width].copy_(linear.bias.detach())
            linear.bias = nn.Parameter(biases[start:start + width])
        start += width
    return linears


def plain_linear(module: nn.Module) -> bool:
    """Whether calling ``module`` is exactly ``F.linear`` with its weight and bias: an ``nn.Linear`` (not a
    subclass such as a LoRA wrapper) with no forward hooks, its own or global. Only then may a caller use
    the weight directly in place of a module call.

    Example:
        >>> plain_linear(nn.Linear(2, 3)), plain_linear(nn.Identity())
        (True, False)
    """
    return type(module) is nn.Linear and not (
        module._forward_hooks or module._forward_pre_hooks or nn.modules.module._global_forward_hooks
        or nn.modules.module._global_forward_pre_hooks)


def packed_weight(linears: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The ``(d_in, total)`` matrix (and ``(total,)`` bias) whose column blocks are these linears' weights,
    or None when they are not (any more) one packed matrix, or one product would skip something a module
    call runs (a hook, a subclass such as a LoRA wrapper). Metadata only; nothing reads tensor data.

    Shapes:
        -> weight (d_in, total), bias (total,) or None
    """
    if not all(plain_linear(m) for m in linears):
        return None
    w0 = linears[0].weight
    d_in, total = w0.shape[1], sum(m.weight.shape[0] for m in linears)
    parts = [[m.weight for m in linears]]
    if linears[0].bias is not None:
        if any(m.bias is None for m in linears):
            return None
        parts.append([m.bias for m in linears])
    elif any(m.bias is not None for m in linears):
        return None
    packed = []
    for tensors in parts:
        first = tensors[0]
        offset, storage = first.storage_offset(), first.untyped_storage().data_ptr()
        for t in tensors:
            stride = (1, total) if t.dim() == 2 else (1,)
            if (t.stride() != stride or t.dtype != first.dtype or t.device != first.device
                    or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset
                    or (t.dim() == 2 and t.shape[1] != d_in)):
                return None
            offset += t.shape[0]
        shape, strides = ((d_in, total), (total, 1)) if first.dim() == 2 else ((total,), (1,))
        packed.append(first.as_strided(shape, strides, first.storage_offset()))
    return packed[0], (packed[1] if len(packed) > 1 else None)


def packed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight + bias`` over a packed ``(d_in, total)`` weight: ``F.linear``'s product. A result large
    enough that glibc would map it fresh on 4 KiB pages (:func:`headwise.buffers.scratch_empty`) is written to
    fresh huge pages instead: a long prompt's packed Q/K/V otherwise faults in one 4 KiB page at a time, on
    every call. Under autocast or a ``torch.jit`` trace (which would keep the mapping as a constant), for
    tensor subclasses and off the CPU this is ``F.linear`` itself.

    Shapes:
        x (..., d_in), weight (d_in, total), bias (total,) -> (..., total)

    Example:
        >>> q, k = packed_linears(8, [8, 4], bias=True)
        >>> w, b = packed_weight([q, k])
        >>> x = torch.randn(2, 3, 8)
        >>> packed_product(x, w, b).shape, torch.allclose(packed_product(x, w, b)[..., 8:], k(x))
        (torch.Size([2, 3, 12]), True)
    """
    n = x.numel() // x.shape[-1]  # rows
    if n * weight.shape[1] * x.element_size() < buffers.MAPPED_BYTES:  # a decode step, every token: no more
        return F.linear(x, weight.t(), bias)
    out = scratch_empty((n, weight.shape[1]), x.dtype, x.device)  # (b * s, total); None: not CPU, or no huge pages
    if (out is None or type(x) is not torch.Tensor or torch.is_autocast_enabled(x.device.type)
            or torch.jit.is_tracing()):
        return F.linear(x, weight.t(), bias)
    rows = x.reshape(n, x.shape[-1])  # (b * s, d_in)
    if bias is None:
        torch.mm(rows, weight, out=out)
    else:
        torch.addmm(bias, rows, weight, out=out)
    return out.view(*x.shape[:-1], weight.shape[1])  # (..., total)


class PackedWeight:
    """:func:`packed_weight` of a layer's linears, remembered: a decode step asks every token, and the
    answer only changes when a module, its type or hooks, or where a weight or bias lives changes.

    Each call checks those (types and hooks, and each tensor's address and strides, the same facts
    :func:`packed_weight` reads) and recomputes only when one differs. The remembered view holds the
    storage it was cut from, so no later tensor can reuse that address while it is remembered.

    Example:
        >>> q, k = packed_linears(8, [8, 4], bias=False)
        >>> memo = PackedWeight()
        >>> memo.get((q, k))[0].shape, memo.get((q, k)) is memo.get((q, k))
        (torch.Size([8, 12]), True)
        >>> q.register_forward_hook(lambda *a: None) is not None, memo.get((q, k)) is None
        (True, True)
    """

    __slots__ = ("key", "value")

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.value: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return PackedWeight, ()  # a copy or an unpickled layer starts with nothing remembered

    def get(self, linears: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The packed ``(d_in, total)`` weight and bias of ``linears``, or None (see :func:`packed_weight`)."""
        key = []
        for m in linears:
            if not plain_linear(m):
                return None
            params = m._parameters  # a decode step's fixed cost is mostly Python: skip Module.__getattr__
            w, b = params["weight"], params["bias"]
            key += (m, w.data_ptr(), w.stride(), w.shape, w.dtype, None if b is None else b.data_ptr())
        key = tuple(key)
        if key != self.key:  # tuples compare element-wise; modules by identity
            self.key, self.value = key, packed_weight(linears)
        return self.value


def repack(linears: Sequence[nn.Module]) -> bool:
    """Lay these linears' weights (and biases) out packed again, keeping their values and their Parameter
    objects (only ``.data`` moves): after a ``.to()`` or a deep copy, which copy each parameter on its own.
    Returns whether they are packed now (plain ``nn.Linear`` of one dtype, device and input width only).

    Shapes:
        each weight: (width, d_in) -> a transposed view of columns of one (d_in, total) matrix
    """
    if packed_weight(linears) is not None:
        return True
    if any(type(m) is not nn.Linear for m in linears) or len({(m.weight.dtype, m.weight.device, m.weight.shape[1])
                                                            for m in linears}) != 1:
        return False
    if len({m.bias is None for m in linears}) != 1:
        return False
    w0 = linears[0].weight
    total = sum(m.weight.shape[0] for m in linears)
    with torch.no_grad():
        weight = fresh_empty((w0.shape[1], total), w0.dtype, w0.device)  # (d_in, total)
        biases = None if linears[0].bias is None else torch.empty(total, dtype=w0.dtype, device=w0.device)
        start = 0
        for m in linears:
            width = m.weight.shape[0]
            weight[:, start:start + width].copy_(m.weight.t())
            m.weight.data = weight[:, start:start + width].t()  # (width, d_in), strides (1, total)
            if biases is not None:
                biases[start:start + width].copy_(m.bias)
                m.bias.data = biases[start:start + width]
            start += width
    return packed_weight(linears) is not None


class PackedLayout:
    """Keeps a layer's own projections packed (:func:`repack`) after ``.to()``/``.double()`` and after a deep
    copy or unpickling, which copy each parameter on its own. A mixin of ``MultiHeadAttention`` (before
    ``nn.Module``): it reads the layer's ``config`` and its ``q_proj``..``out_proj``.
    """

    def _apply(self, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = super()._apply(fn, *args, **kwargs)  # .to()/.double()/... convert each parameter on its own
        self._repack()
        return out

    def __setstate__(self, state):  # type: ignore[no-untyped-def]
        super().__setstate__(state)  # deepcopy and unpickling copy each parameter on its own
        self._repack()

    def _repack(self) -> None:
        own = [self._modules.get(n) for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
        if any(m is None for m in own) or own != [self.q_proj, self.k_proj, self.v_proj, self.out_proj]:
            return  # projections that belong to someone else (a view of a host model) are left alone
        cfg = self.config
        packed_qkv = cfg.kdim == cfg.vdim == cfg.d_model
        if packed_qkv:
            repack(own[:3])
        for m in own[3:] if packed_qkv else own:
            repack([m])
