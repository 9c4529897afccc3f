"""Which heads matter: the per-head activation-patching sweep and per-head direct attribution.

* :func:`head_effects`: for every (layer, head), how much ``metric`` changes when that head's context z is
  patched from the clean run into the corrupted run (the standard sweep). It is *batched over heads*: one
  forward carries many patched copies of the corrupted input side by side along the batch axis, copy ``j``
  patching its own (layer, head) through :func:`headwise.trace` edits; by default the copies of one forward
  are the heads of one layer, so the sweep costs 2 + n_layers forwards (of batch n_heads x b) instead of
  n_layers x n_heads forwards (of batch b). Each forward also runs the blocks before its patched layer once,
  at batch b (they are the same for every copy), and saves the per-forward overhead that dominates at the
  short inputs patching is used on.
* :func:`attribution`: attribution patching, the first-order estimate of :func:`head_effects` from one
  forward on each input and one backward (the captures are the tensors the forward used, so they have
  gradients).
* :func:`direct_effects`: each head's direct contribution to a residual direction (e.g. a logit difference,
  :func:`logit_direction`) through the final norm, linearised: the norm's scale (LayerNorm's standard
  deviation, RMSNorm's root mean square) is frozen at this run, so the norm is affine and the heads'
  contributions plus those of every other residual component sum to the direction's value minus the norm's
  bias term. Only the direct path is counted (not effects through later layers).

Each takes the model's inputs as users have them (a tensor, a tuple, any mapping such as a tokenizer's
``BatchEncoding``: :mod:`headwise.tracing.inputs`) and runs the model in eval mode for its duration, every
module's mode given back afterwards; a metric is ``metric(output)`` or ``metric(output, inputs)``. A
transformers ``Cache`` among the inputs (a prefix's ``cache`` / ``past_key_values``) is deep-copied for every
run, so each run starts from the prefix and the caller's cache never changes. A layer run several times in one
forward (ALBERT's shared layer) is refused with a ValueError: its calls are not one site per head.

Shapes:
    b: batch, s: sequence, L: traced layers, h: heads, d: model width (d_model), d_h: head width (d_head).

Example:
    >>> import torch, headwise
    >>> torch.manual_seed(0) and None
    >>> model = torch.nn.Sequential(headwise.MultiHeadAttention(8, 2), headwise.MultiHeadAttention(8, 2)).eval()
    >>> clean, corrupted = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    >>> effects = headwise.patching.head_effects(model, clean, corrupted, lambda y: y[0, -1, 0])
    >>> effects.shape
    torch.Size([2, 2])
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .tracing import find_layers, trace
from .tracing.inputs import batch_size, caches, call, differentiable, eval_mode, metric_of, repeat
from .tracing.layers import encoder_modules
from .tracing.progress import check_progress, progress_bar
from .direct import direct_effects, final_norm, logit_direction

__all__ = ["head_effects", "attribution", "direct_effects", "logit_direction", "final_norm"]

_SITES = ("q", "k", "v", "pattern", "z")


# -- outputs along the batch axis -----------------------------------------------------------------------
def _split(out: Any, n: int, b: int) -> list[Any]:
    """The model output of ``n`` stacked copies as ``n`` outputs of batch ``b`` (tensors, tuples, dicts and
    Hugging Face ``ModelOutput``s; anything else is shared)."""
    if isinstance(out, torch.Tensor):
        if out.dim() > 0 and out.shape[0] == n * b:
            return [out[j * b:(j + 1) * b] for j in range(n)]
        return [out] * n
    if isinstance(out, dict):
        parts = {k: _split(v, n, b) for k, v in out.items()}
        return [type(out)(**{k: p[j] for k, p in parts.items()}) for j in range(n)]
    if isinstance(out, (tuple, list)):
        parts = [_split(v, n, b) for v in out]
        return [type(out)(p[j] for p in parts) for j in range(n)]
    return [out] * n


def _batch_major(out: Any, rows: int) -> bool:
    """Whether every tensor in a model output has ``rows`` on dim 0, so that :func:`_split` gives each copy its
    own; a loss reduced over the batch (Hugging Face's ``loss`` when ``labels`` are among the inputs) does not."""
    if isinstance(out, torch.Tensor):
        return out.dim() > 0 and out.shape[0] == rows
    if isinstance(out, dict):
        return all(_batch_major(v, rows) for v in out.values())
    if isinstance(out, (tuple, list)):
        return all(_batch_major(v, rows) for v in out)
    return True


def _scalar(value: Any) -> torch.Tensor:
    try:
        t = torch.as_tensor(value).detach()
    except (TypeError, RuntimeError, ValueError):  # torch's own message does not mention the metric
        raise TypeError(f"metric must return a number or a scalar tensor, got {type(value).__name__}") from None
    if t.numel() != 1 or not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"metric must return one number (a scalar tensor or float), got "
                         f"{tuple(t.shape) if t.numel() != 1 else t.dtype}")
    return t.reshape(()).double()


# -- checks shared by the sweep and attribution ------------------------------------------------------------
def _pair(clean: Any, corrupted: Any, what: str) -> int:
    """The batch size b that ``clean`` and ``corrupted`` share, else a ValueError naming both."""
    b, b_bad = batch_size(clean, f"{what}(clean)"), batch_size(corrupted, f"{what}(corrupted)")
    if b_bad != b:
        raise ValueError(f"{what}: clean and corrupted must have the same batch size, got {b} and {b_bad}")
    return b


def _same_shapes(t_clean: Any, t_bad: Any, site: str, what: str) -> None:
    """A ValueError unless every layer's ``site`` has one shape on both inputs (a head's clean slice replaces,
    or is subtracted from, its corrupted one)."""
    for rc, rb in zip(t_clean, t_bad):
        xc, xb = rc.get(site), rb.get(site)
        if xc.shape != xb.shape:
            raise ValueError(f"{what}: layer {rc.index} ({rc.name!r}) has {site} of shape {tuple(xc.shape)} on the "
                             f"clean input and {tuple(xb.shape)} on the corrupted one; they must match")


def _one_call_each(t: Any, what: str) -> None:
    """A ValueError naming a layer that ran several times in one forward (its heads are not one site each)."""
    for record in t:
        record.require_one_call(what)


# -- the sweep -------------------------------------------------------------------------------------------
def _site(site: Any) -> str:
    if site not in _SITES:
        raise ValueError(f"site must be one of {_SITES}, got {site!r}")
    return site


def _head_slices(record: Any, site: str, layer: Any) -> list[torch.Tensor]:
    """Each query head's slice of a captured site, head-major: q, z (b, s_q, d_h); k, v (b, s_kv, d_h) (the
    K/V head it reads); pattern (b, s_q, s_kv)."""
    x = record.get(site)
    if site == "z":
        return list(x.unbind(2))
    g = layer.n_heads // x.shape[1]
    return [x[:, i // g] for i in range(layer.n_heads)]


@torch.no_grad()
def head_effects(model: nn.Module, clean: Any, corrupted: Any, metric: Callable[..., Any], *,
                 site: str = "z", per_position: bool = False, batch_heads: int | None = None,
                 share_prefix: bool = True, progress: bool | None = None) -> torch.Tensor:
    """``metric(patched) - metric(corrupted)`` for every (layer, head) whose ``site`` is patched from ``clean``.

    ``clean`` and ``corrupted`` are the model's inputs (a tensor, a tuple of positional inputs, or any mapping
    of keyword inputs: a dict, a tokenizer's ``BatchEncoding``) of identical shapes with the batch on dim 0.
    ``metric(output)`` (or ``metric(output, inputs)``, given the corrupted inputs, e.g. for mean pooling over
    the attention mask) takes one model output of that batch and returns a number. ``site`` is what is
    patched: ``"z"`` (the head's context, default), ``"q"``, ``"k"``, ``"v"`` (the query head's own view of its
    group's K/V) or ``"pattern"``; with ``per_position`` one position at a time (query positions; key
    positions for k and v). ``batch_heads`` (default: the heads of one layer) is how many patched copies share
    one forward; memory grows with it. With ``share_prefix`` (the default) the blocks before the first patched
    layer of a forward run once, at batch b: the copies split off at the block (the numbered child of a
    ``ModuleList``/``Sequential``) holding that layer, whose batch-b tensor inputs are repeated; where no such
    block is found, the layer is in the encoder of an encoder-decoder model (whose decoder takes batch-b
    inputs beside the encoder's output), or the model refuses the split batch, every copy runs the whole
    forward. An output tensor without the batch on dim 0 (a ``loss`` reduced over the batch, when ``labels``
    are among the inputs; MoE router logits, token-major) cannot be split among copies: where the corrupted
    run's output holds one, each copy runs alone from the start, as it does where the inputs hold a
    transformers ``Cache`` (of batch b). The clean and corrupted inputs must give every layer's ``site`` one
    shape (ValueError). The model runs in eval mode for the duration (dropout off; every module's mode is given
    back afterwards).

    Args:
        model: a MultiHeadAttention, a module containing them, or a patched Hugging Face model.
        clean, corrupted: the two inputs.
        metric: output -> number, or (output, inputs) -> number.
        site: the site patched.
        per_position: patch one position at a time.
        batch_heads: patched copies per forward.
        share_prefix: run the unpatched prefix once per forward instead of once per copy.
        progress: a progress bar: None (on a terminal or in a notebook, for sweeps longer than half a
            second), True or False.

    Shapes:
        inputs: batch b on dim 0 -> (L, h) float64, or (L, h, s) with per_position (NaN where a layer has
        fewer heads or positions than the widest)
    """
    site = _site(site)
    measure = metric_of(metric, "head_effects")
    check_progress(progress, "head_effects")
    b = _pair(clean, corrupted, "head_effects")
    if batch_heads is not None and (isinstance(batch_heads, bool) or not isinstance(batch_heads, int)
                                    or batch_heads < 1):
        raise ValueError(f"batch_heads must be a positive int, got {batch_heads!r}")
    # a cache holds the inputs' batch b, which copies side by side cannot share: each copy runs alone
    stateful = bool(caches(clean) or caches(corrupted))
    with eval_mode(model):
        with trace(model, capture=(site,)) as t_clean:
            call(model, clean)
        _one_call_each(t_clean, "head_effects")
        with trace(model, capture=(site,)) as t_bad:
            out = call(model, corrupted)
            base = _scalar(measure(out, corrupted))
        # a tensor mixing the batch (a loss reduced over it) would mix the copies of a forward: run them alone
        alone = stateful or not _batch_major(out, b)
        del out  # the sweep's outputs need the memory
        _same_shapes(t_clean, t_bad, site, "head_effects")
        sources = [[x.detach() for x in _head_slices(rc, site, rc.layer)] for rc in t_clean]  # per head (b, s, n)
        heads = [layer.n_heads for _, layer in t_clean.layers]
        lengths = [src[0].shape[1] for src in sources]
        pairs = [(li, i, p) for li, h in enumerate(heads) for i in range(h)
                 for p in (range(lengths[li]) if per_position else [None])]
        per = 1 if alone else heads[0] if batch_heads is None else batch_heads
        blocks = _blocks(model, [name for name, _ in t_clean.layers]) if share_prefix and not alone else None
        shape = (len(heads), max(heads), max(lengths)) if per_position else (len(heads), max(heads))
        effects = torch.full(shape, float("nan"), dtype=torch.float64)
        with progress_bar(-(-len(pairs) // per), "head_effects", progress) as advance:
            for start in range(0, len(pairs), per):
                chunk = pairs[start:start + per]
                for (li, i, p), out in zip(chunk, _patched_outputs(model, corrupted, chunk, sources, site, blocks, b)):
                    effects[(li, i) if p is None else (li, i, p)] = _scalar(measure(out, corrupted)) - base
                advance(1)
    return effects


def _patched_outputs(model: nn.Module, corrupted: Any, chunk: list[tuple[int, int, int | None]],
                     sources: list[list[torch.Tensor]], site: str, blocks: list[nn.Module] | None,
                     b: int) -> list[Any]:
    """The outputs of one forward of ``len(chunk)`` patched copies of the corrupted batch, one per copy."""
    n = len(chunk)
    rows: dict[tuple[int, int], list[tuple[int, int | None]]] = {}
    for j, (li, i, p) in enumerate(chunk):
        rows.setdefault((li, i), []).append((j, p))
    edit = {(li, i, site): _patch_rows(sources[li][i], where, n, b) for (li, i), where in rows.items()}
    out = None
    if blocks is not None and blocks[chunk[0][0]] is not None and n > 1:
        later = [blk for blk in blocks[chunk[0][0]:] if blk is not None]
        try:
            out = _forward_split(model, corrupted, edit, later, n, b)
        except (RuntimeError, ValueError, IndexError):  # batch-b and split tensors met: run every copy
            pass
    if out is None:
        with trace(model, edit=edit):
            out = call(model, repeat(corrupted, n))
    if n > 1 and not _batch_major(out, n * b):
        # a tensor whose dim 0 was b by chance in the corrupted run, not the copies': run each copy alone
        return [_patched_outputs(model, corrupted, [pair], sources, site, blocks, b)[0] for pair in chunk]
    return _split(out, n, b)


def _patch_rows(source: torch.Tensor, where: list[tuple[int, int | None]], n: int, b: int) -> Callable[..., torch.Tensor]:
    """An edit that puts ``source`` (b, s, n) into the rows of each copy ``j`` in ``where`` (at position ``p``
    only, unless None) and leaves the other copies alone."""
    def edit(x_h: torch.Tensor, layer: int, head: int) -> torch.Tensor:
        if x_h.shape[0] != n * b:  # the copies did not reach this layer: never patch the wrong rows
            raise ValueError(f"layer {layer} saw batch {x_h.shape[0]}, not the {n} x {b} patched copies")
        out = x_h.clone()  # (n * b, s, n)
        for j, p in where:
            if p is None:
                out[j * b:(j + 1) * b] = source.to(x_h.dtype)
            else:
                out[j * b:(j + 1) * b, p] = source[:, p].to(x_h.dtype)
        return out
    return edit


def attribution(model: nn.Module, clean: Any, corrupted: Any, metric: Callable[..., Any], *,
                site: str = "z", per_position: bool = False) -> torch.Tensor:
    """Attribution patching: the first-order estimate of :func:`head_effects`, from one forward on each input
    and one backward. For every head, ``sum((x_clean - x_corrupted) * d metric / d x)`` over the head's slice
    of ``site`` (its own view of K/V for k and v), the gradient taken on the corrupted run. ``clean`` and
    ``corrupted`` must share the batch size and give every layer's ``site`` one shape, as for
    :func:`head_effects` (ValueError). The model runs in eval mode for the duration (dropout off), every
    module's mode given back afterwards.

    Args:
        model: a MultiHeadAttention, a module containing them, or a patched Hugging Face model.
        clean, corrupted: the two inputs (as for :func:`head_effects`).
        metric: output (or output, inputs) -> a scalar tensor that autograd can differentiate.
        site: ``"z"`` (default), ``"q"``, ``"k"``, ``"v"`` or ``"pattern"``.
        per_position: one estimate per position (query positions; key positions for k and v).

    Shapes:
        -> (L, h) float64, or (L, h, s) with per_position (NaN where a layer has fewer heads or positions)

    Example:
        >>> import torch, headwise
        >>> torch.manual_seed(0) and None
        >>> model = torch.nn.Sequential(headwise.MultiHeadAttention(8, 2), headwise.MultiHeadAttention(8, 2)).eval()
        >>> clean, corrupted = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
        >>> headwise.patching.attribution(model, clean, corrupted, lambda y: y[0, -1, 0]).shape
        torch.Size([2, 2])
    """
    site = _site(site)
    measure = metric_of(metric, "attribution")
    _pair(clean, corrupted, "attribution")
    # k and v: every query head gets its own K/V copy (an identity edit), so each head's view has a gradient.
    own = {(li, None, site): (lambda x, layer, head: x) for li in range(len(find_layers(model)))} \
        if site in ("k", "v") else None
    with eval_mode(model):
        with torch.no_grad(), trace(model, capture=(site,), edit=own) as t_clean:
            call(model, clean)
        _one_call_each(t_clean, "attribution")
        with torch.enable_grad(), trace(model, capture=(site,), edit=own) as t_bad:
            value = differentiable(measure(call(model, corrupted), corrupted), "attribution")
            _one_call_each(t_bad, "attribution")
            _same_shapes(t_clean, t_bad, site, "attribution")
            captured = [r.get(site) for r in t_bad]
            grads = torch.autograd.grad(value, captured, allow_unused=True)
    per_layer = []
    for rc, rb, grad in zip(t_clean, t_bad, grads):
        if grad is None:
            if isinstance(getattr(model, "_orig_mod", None), nn.Module):  # what torch.compile(model) returns
                raise ValueError(f"attribution: got a compiled model (torch.compile(model)), whose graph computes the "
                                 f"metric without the captured {site} tensors, so they have no gradient; pass the "
                                 "model itself (attribution(model, ...), or model._orig_mod) rather than "
                                 "torch.compile(model)")
            raise ValueError(f"attribution: layer {rb.index} ({rb.name!r}) {site} does not reach the metric")
        delta = (rc.get(site).detach() - rb.get(site).detach()).double() * grad.double()
        head_axis = 2 if site == "z" else 1
        delta = delta.movedim(head_axis, 1)  # (b, h, s, n)
        per_layer.append(delta.sum(dim=(0, 3)) if per_position else delta.sum(dim=(0, 2, 3)))  # (h, s) or (h,)
    shape = (len(per_layer), *(max(x.shape[k] for x in per_layer) for k in range(per_layer[0].dim())))
    out = torch.full(shape, float("nan"), dtype=torch.float64)  # NaN where a layer is narrower
    for li, x in enumerate(per_layer):
        out[(li, *(slice(0, n) for n in x.shape))] = x
    return out


def _blocks(model: nn.Module, names: list[str]) -> list[nn.Module | None] | None:
    """Per traced layer, the block holding it: its nearest ancestor that is a numbered child of a
    ``ModuleList`` or ``Sequential`` (``encoder.layer.3``, ``transformer.h.0``, ``model.layers.1``); None for a
    layer in the encoder of an encoder-decoder model, whose copies would reach the decoder beside its batch-b
    inputs (the cross-attention mask), so they run the whole forward. None for all when a layer has no block or
    two layers share one."""
    modules = dict(model.named_modules())
    encoder = encoder_modules(model)
    found = []
    for name in names:
        if encoder is None or name in encoder:  # an encoder (or one that cannot be told apart): no split
            found.append(None)
            continue
        parts = name.split(".") if name else []
        block = None
        for k in range(len(parts), 0, -1):
            parent = modules.get(".".join(parts[:k - 1]))
            if parts[k - 1].isdigit() and isinstance(parent, (nn.ModuleList, nn.Sequential)):
                block = modules[".".join(parts[:k])]
                break
        if block is None:
            return None
        found.append(block)
    split = [id(m) for m in found if m is not None]
    if len(set(split)) != len(split):
        return None  # two layers in one block: the split point would be ambiguous
    return found


def _forward_split(model: nn.Module, inputs: Any, edit: dict, blocks: list[nn.Module], n: int, b: int) -> Any:
    """One forward at batch b up to ``blocks[0]``; from there on every batch-b input of a block (rank >= 2)
    is repeated ``n`` times, copy-major, so the blocks run the ``n`` patched copies."""
    def expand(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.repeat(n, *([1] * (value.dim() - 1))) if value.dim() >= 2 and value.shape[0] == b else value
        if isinstance(value, (tuple, list)):
            return type(value)(expand(v) for v in value)
        return value

    handles = [blk.register_forward_pre_hook(
        lambda m, args, kwargs: (expand(args), {k: expand(v) for k, v in kwargs.items()}), with_kwargs=True)
        for blk in blocks]
    try:
        with trace(model, edit=edit):
            return call(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
