"""Model inputs as users have them, and the metrics that read a run: what every sweep, score and picture shares.

* :func:`call`: ``model(inputs)`` for a tensor, ``model(*inputs)`` for a tuple or list of positional inputs,
  ``model(**inputs)`` for any ``Mapping`` of keyword inputs (a ``dict``, a tokenizer's ``BatchEncoding``). A
  transformers ``Cache`` among the inputs (a prefix's ``cache`` / ``past_key_values``) grows in place as the model
  runs, so each call runs on its own copy (:func:`caches`): every run sees the inputs as given, and the caller's
  cache never changes.
* :func:`batch_size` / :func:`repeat`: the batch on dim 0 of every tensor input, and ``n`` copies of it.
* :func:`metric_of`: a metric is ``metric(output)`` or ``metric(output, inputs)`` (the inputs of that run,
  as given: e.g. the attention mask for mean pooling over real tokens).
* :func:`eval_mode`: the model in eval mode for the duration of a block (dropout off), every module's own
  mode given back afterwards.

Shapes:
    b: batch (dim 0 of every tensor input), s: tokens.

Example:
    >>> import torch
    >>> from headwise.tracing.inputs import batch_size, call, repeat
    >>> enc = {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5)}
    >>> batch_size(enc, "example"), repeat(enc, 3)["input_ids"].shape
    (2, torch.Size([6, 5]))
    >>> call(lambda input_ids, attention_mask: input_ids.sum(), enc)
    tensor(10)
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
from torch import nn

__all__ = ["call", "batch_size", "tensors_of", "repeat", "caches", "check_inputs", "metric_of", "differentiable",
           "eval_mode", "token_ids"]


def check_inputs(inputs: Any, what: str) -> None:
    """``TypeError`` naming ``what`` unless ``inputs`` is a tensor, a tuple/list, or a Mapping with string keys
    (a text is refused: the model takes token ids, so tokenize it first)."""
    if isinstance(inputs, (str, bytes)):
        raise TypeError(f"{what}: the model's inputs must be a tensor, a tuple of positional inputs or a mapping of "
                        f"keyword inputs (e.g. tokenizer(texts, return_tensors='pt')), got a {type(inputs).__name__}; "
                        "tokenize the text first")
    if isinstance(inputs, Mapping):
        bad = [k for k in inputs if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{what}: a mapping of model inputs must have keyword names (str) as keys, got "
                            f"{type(bad[0]).__name__} key {bad[0]!r}")


def caches(inputs: Any) -> list[str]:
    """Where ``inputs`` hold a transformers ``Cache`` (state the model grows in place): the keyword names, or
    ``"#i"`` for positional inputs; empty for none.

    Example:
        >>> caches({"input_ids": torch.ones(1, 3, dtype=torch.long)})
        []
    """
    utils = sys.modules.get("transformers.cache_utils")  # a Cache exists only once transformers is imported
    kind = getattr(utils, "Cache", None)
    if kind is None:
        return []
    if isinstance(inputs, Mapping):
        return [k for k, v in inputs.items() if isinstance(v, kind)]
    if isinstance(inputs, (tuple, list)):
        return [f"#{i}" for i, v in enumerate(inputs) if isinstance(v, kind)]
    return ["#0"] if isinstance(inputs, kind) else []


def _copy_cache(cache: Any) -> Any:
    """A deep copy of a transformers ``Cache``. A tensor that autograd computed (a prefix run with gradients on)
    cannot be deep-copied, so it is cloned: the copy's states keep their gradient path to the prefix."""
    memo: dict[int, Any] = {}
    todo, seen = [cache], set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.grad_fn is not None:
                memo[id(obj)] = obj.clone()
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif type(obj).__module__.startswith("transformers.") and hasattr(obj, "__dict__") \
                and not isinstance(obj, nn.Module):
            todo.extend(vars(obj).values())  # the cache and its layers, never a model
    return copy.deepcopy(cache, memo)


def _own_caches(inputs: Any) -> Any:
    """``inputs`` with a deep copy in place of every transformers ``Cache`` (the caller's is never grown)."""
    if not caches(inputs):
        return inputs
    kind = sys.modules["transformers.cache_utils"].Cache

    def own(v: Any) -> Any:
        return _copy_cache(v) if isinstance(v, kind) else v

    if isinstance(inputs, Mapping):
        return {k: own(v) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(own(v) for v in inputs)
    return own(inputs)


def call(model: Callable[..., Any], inputs: Any) -> Any:
    """``model`` run on ``inputs``: keyword inputs from any Mapping, positional ones from a tuple or list; a
    transformers ``Cache`` among them is deep-copied first, so that the run neither sees an earlier run's
    positions in it nor adds its own to the caller's."""
    inputs = _own_caches(inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def tensors_of(inputs: Any) -> list[Any]:
    """The values of a mapping, the items of a tuple or list, or ``[inputs]``: what a model call is given."""
    if isinstance(inputs, Mapping):
        return list(inputs.values())
    if isinstance(inputs, (tuple, list)):
        return list(inputs)
    return [inputs]


def batch_size(inputs: Any, what: str) -> int:
    """The one batch size on dim 0 of every tensor input (rank >= 1), else ``ValueError`` naming the sizes."""
    check_inputs(inputs, what)
    sizes = {t.shape[0] for t in tensors_of(inputs) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        kinds = sorted({type(t).__name__ for t in tensors_of(inputs)})
        raise ValueError(f"{what}: the input tensors must share one batch size on dim 0, got dim-0 sizes "
                         f"{sorted(sizes) if sizes else 'none (no tensor among ' + ', '.join(kinds) + ')'}")
    return sizes.pop()


def repeat(inputs: Any, n: int) -> Any:
    """``n`` copies of the batch, copy-major (rows ``j * b .. (j + 1) * b`` are copy ``j``); a Mapping becomes a
    plain dict of the same keys, non-tensor values are shared. A transformers ``Cache`` holds batch b, which
    ``n > 1`` copies cannot share: refused (ValueError).

    Shapes:
        every tensor (b, ...) -> (n * b, ...)
    """
    held = caches(inputs) if n > 1 else []
    if held:
        raise ValueError(f"repeat: the input {held[0]!r} is a transformers Cache of the inputs' batch, which {n} "
                         "copies of the batch cannot share; run the copies one at a time")

    def rep(t: Any) -> Any:
        return t.repeat(n, *([1] * (t.dim() - 1))) if isinstance(t, torch.Tensor) and t.dim() > 0 else t

    if isinstance(inputs, Mapping):
        return {k: rep(v) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(rep(v) for v in inputs)
    return rep(inputs)


def token_ids(inputs: Any) -> torch.Tensor | None:
    """The ``input_ids`` of keyword inputs, or the inputs themselves when they are one integer tensor; else None.

    Shapes:
        -> (b, s) integer tensor or None
    """
    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else inputs
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point() and not ids.is_complex():
        return ids
    return None


def _positional(metric: Callable[..., Any]) -> tuple[int, int, bool] | None:
    """(required positional parameters, all positional parameters, whether it takes *args) of ``metric``, or
    None when it has no signature."""
    try:
        params = list(inspect.signature(metric).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: called with the output alone
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(1 for p in positional if p.default is p.empty)
    return required, len(positional), any(p.kind is p.VAR_POSITIONAL for p in params)


def metric_of(metric: Any, what: str) -> Callable[[Any, Any], Any]:
    """``metric`` as a function of (output, inputs): ``metric(output)`` when it takes one required positional
    argument (or only optional ones), ``metric(output, inputs)`` when it takes two; ``TypeError`` naming
    ``what`` otherwise."""
    if not callable(metric):
        raise TypeError(f"{what}: metric must be a function of the model's output (metric(output) or "
                        f"metric(output, inputs)), got {type(metric).__name__}")
    shape = _positional(metric)
    if shape is None:
        return lambda output, inputs: metric(output)
    required, positional, var = shape
    if required == 2:
        return lambda output, inputs: metric(output, inputs)
    if required == 1 or (required == 0 and (positional or var)):
        return lambda output, inputs: metric(output)
    raise TypeError(f"{what}: metric must take the model's output, or the output and the inputs of that run "
                    f"(metric(output) or metric(output, inputs)); got a function of {required} required "
                    "positional arguments")


def differentiable(value: Any, what: str) -> torch.Tensor:
    """``value`` as a 0-d tensor that autograd can differentiate, else a ``TypeError`` (not a tensor: a float,
    ``.item()``) or ``ValueError`` (several elements, complex, or no graph: detached, or computed under
    ``no_grad``) saying what the metric must return."""
    must = "metric must return a one-element tensor computed from the model's output, so that autograd can " \
           "differentiate it (e.g. a loss; not .item() or float(...))"
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: {must}, got {type(value).__name__}")
    if value.is_complex():  # a gradient is defined for real scalars only
        raise ValueError(f"{what}: metric must be real (a floating-point tensor), got a {value.dtype} tensor")
    if value.numel() != 1 or not value.is_floating_point():
        raise ValueError(f"{what}: {must}, got a {value.dtype} tensor of shape {tuple(value.shape)}")
    if not value.requires_grad:
        raise ValueError(f"{what}: {must}; the tensor it returned has no gradient (detached, or computed under "
                         "torch.no_grad)")
    return value.reshape(())


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model.eval()`` for the duration of the block (dropout off: a sweep or score is then the same number on
    every run), then every submodule's own ``training`` flag back, mixed modes included."""
    if not isinstance(model, nn.Module):  # not a model: the caller's own checks refuse it
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    if not any(training for _, training in modes):
        yield
        return
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
