"""What :func:`headwise.viz.model_statistics` changes in each layer's attention call for the length of its run:
padding query rows read nothing (:func:`padding_reads_nothing`), and each layer's readable keys per query are
counted from the mask and causality the call was given (:func:`counting_readable`), so that its numbers can be
judged against uniform attention.

Shapes:
    b: batch, s_q: queries, s_kv: keys.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

__all__ = ["padding_reads_nothing", "counting_readable"]

# Query rows per chunk when counting the keys each may read: bounds the (rows, s_kv) bool array.
_COUNT_ROWS = 1024


def _first_real(mask: Any, row: int) -> int:
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask[row].bool().any()):
        return int(mask[row].bool().nonzero()[0])
    return 0


def _readable(q: torch.Tensor, k: torch.Tensor, mask: Any, causal: bool, row: int,
              first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """((s_q,) int, (s_q,) bool) for batch row ``row`` of one call: how many keys each query may read (``mask``:
    bool, True = may attend, or additive, finfo.min / -inf = may not; ``causal`` bottom-right), and whether it
    may read key ``first``. The mask's first head stands for all."""
    s_q, s_kv = q.shape[-2], k.shape[-2]
    m = None
    if isinstance(mask, torch.Tensor):
        m = mask[(None,) * (4 - mask.dim())] if mask.dim() < 4 else mask
        m = m[row if m.shape[0] > 1 else 0, 0]  # (s_q or 1, s_kv or 1)
        m = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    count, first_ok = torch.zeros(s_q, dtype=torch.long), torch.zeros(s_q, dtype=torch.bool)
    keys = torch.arange(s_kv)
    for i0 in range(0, s_q, _COUNT_ROWS):
        i1 = min(s_q, i0 + _COUNT_ROWS)
        allowed = torch.ones(i1 - i0, s_kv, dtype=torch.bool)
        if m is not None:
            allowed = allowed & (m[i0:i1] if m.shape[0] > 1 else m).cpu()
        if causal:
            allowed = allowed & (keys[None, :] <= torch.arange(i0, i1)[:, None] + (s_kv - s_q))
        count[i0:i1], first_ok[i0:i1] = allowed.sum(-1), allowed[:, first]
    return count, first_ok


@contextlib.contextmanager
def counting_readable(layers: list, row: int, attention_mask: Any,
                       seen: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """For the block, record in ``seen[id(layer)]`` the first self-attention call's readable keys per query
    (:func:`_readable`, from the mask and causality the call was given)."""
    first = _first_real(attention_mask, row)

    def wrapped(layer: Any, attend: Any) -> Any:
        def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Any = None, **kwargs: Any) -> Any:
            plan = kwargs.get("plan")
            causal = bool(kwargs.get("causal", False)) or bool(getattr(plan, "causal", False))
            if id(layer) not in seen and q.shape[-2] == k.shape[-2] and first < k.shape[-2]:
                seen[id(layer)] = _readable(q, k, mask, causal, row if q.shape[0] > 1 else 0, first)
            return attend(q, k, v, mask=mask, **kwargs)

        return recording

    with _attend_wrapped(layers, wrapped):
        yield


@contextlib.contextmanager
def padding_reads_nothing(layers: list, attention_mask: Any) -> Iterator[None]:
    """For the block, every padding query row (``attention_mask`` 0) of ``layers`` reads no key, so that it adds
    nothing to ``key_weight``: eager's additive mask (finfo.min, not -inf) lets a row masked off everywhere read
    every key evenly, and an encoder's padding rows read the real keys. No real row's numbers change: no real row
    reads a padding key, so nothing a padding row computes reaches one. Calls whose queries are not the
    mask's positions (a decode step, cross-attention), calls without a mask and a headwise layer's calls with a
    KV cache are left as they are.

    Shapes:
        attention_mask: (b, s), 1 = a real token
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or bool(attention_mask.bool().all()):
        yield
        return
    real = attention_mask.bool()

    def wrapped(layer: Any, attend: Any) -> Any:
        def attend_real_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Any = None,
                             **kwargs: Any) -> Any:
            plan = kwargs.get("plan")
            if isinstance(mask, torch.Tensor) and (q.shape[0], q.shape[2]) == real.shape and \
                    (plan is None or kwargs.get("cache") is None):
                rows = real.to(mask.device)[:, None, :, None]  # (b, 1, s_q, 1)
                mask = mask & rows if mask.dtype == torch.bool else torch.where(rows, mask, float("-inf"))
                if plan is not None:
                    # forward planned the call on its own mask (no row reading nothing): attend plans it again on
                    # this one; a cached call is not re-planned, as its keys are read the way its plan says
                    # (the weights only where the plan built them: forward asks attend for them on every call)
                    kwargs = {**kwargs, "plan": None, "causal": plan.causal, "return_weights": plan.return_weights}
            return attend(q, k, v, mask=mask, **kwargs)

        return attend_real_rows

    with _attend_wrapped(layers, wrapped):
        yield


@contextlib.contextmanager
def _attend_wrapped(layers: list, wrap: Callable[[Any, Any], Any]) -> Iterator[None]:
    """For the block, each layer's ``attend`` is ``wrap(layer, its attend)``, on that instance only; a layer
    shared by two places is wrapped once, and every layer gets its own ``attend`` back however the block ends."""
    unique = list({id(layer): layer for layer in layers}.values())
    saved = [(layer, layer.__dict__.get("attend")) for layer in unique]
    try:
        for layer, _ in saved:
            layer.__dict__["attend"] = wrap(layer, layer.attend)
        yield
    finally:
        for layer, before in saved:
            if before is None:
                layer.__dict__.pop("attend", None)
            else:
                layer.__dict__["attend"] = before
