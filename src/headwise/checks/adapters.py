"""Adapters: one calling convention for every layer :func:`headwise.check` can test.

An :class:`Adapter` runs a layer on ``x`` (b, s, d_model) with an optional key padding mask and causal
flag, and declares what else it can expose: attention weights, per-head contexts (the input of W_O),
each head's slice of W_Q/W_K/W_V, a decode-with-cache path. Properties use only what an adapter offers
and skip the rest. Shipped adapters:

* :class:`CallableAdapter`: any ``f(x) -> y``; keywords ``mask=``/``causal=``/``return_weights=`` are used
  when its signature has them (headwise's calling convention: bool mask True = may attend), or when it takes
  ``**kwargs`` and honours them (:mod:`.keywords`).
* :class:`~headwise.checks.module_adapter.ModuleAdapter`: an ``nn.Module`` with that convention, its heads
  read off its projections (:mod:`.module_adapter`).
* ``torch.nn.MultiheadAttention``: :class:`~headwise.checks.torch_mha.TorchMHAAdapter` (built on these).
* Hugging Face attention modules: :mod:`headwise.checks.hf_adapter` (built on these).

:func:`headwise.checks.choose.adapt` picks the adapter for a layer.

Shapes:
    b: batch, s: tokens, d: d_model, h: query heads, h_kv: key/value heads, d_h: head width.
    run: x (b, s, d), keep (b, s) bool -> (b, s, d); weights (b, h, s, s); contexts (b, h, s, d_h).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .copies import copy_adapter, copy_held
from .hf_module import relative_bias
from .keywords import FLAGS, confirmed, signature_keywords

__all__ = ["Adapter", "CallableAdapter", "NotExposed", "check_rotary_scaling", "causal_keep", "copy_adapter", "split",
           "capture_input"]

# (tensor, dim, start, stop): one head's slice of a projection weight or bias
Slice = tuple[torch.Tensor, int, int, int]


class NotExposed(Exception):
    """What an adapter offers cannot be read on this layer (its W_O never ran as a module, so the per-head contexts
    were never seen): the property that needs it is skipped with this reason; it is the check's limit, never an
    error of the layer."""


class Adapter:
    """Base class: subclass it to check a layer with a calling convention of its own.

    Set the capability flags and override the methods that go with them; everything else is skipped.

    Shapes:
        run: x (b, s, d), keep (b, s) bool (True = real token) -> (b, s, d)
        run_weights: -> (b, s, d), weights (b, h, s, s); qk: -> q (b, h, s, d_h), k (b, h_kv, s, d_h)
        values: -> (b, h_kv, s, d_h); contexts: -> (b, h, s, d_h), each head's output before W_O
        position_bias: -> (1, h, s, s)
    """

    name: str = "layer"
    d_model: int = 0
    claims_causal: bool = False   # the layer says it is causal: property 3 applies
    accepts_causal: bool = False  # it can be run with causal masking on and off
    accepts_mask: bool = False    # it takes a key padding mask
    positional: bool = False      # it takes token positions (rotary): permutations move them along
    exposes_weights: bool = False
    exposes_heads: bool = False
    has_cache: bool = False
    window: int | None = None     # causal with a sliding window: query p reads keys p - window + 1 .. p only
    sinks: bool = False           # attention sinks take part of each row: weights sum to at most 1
    scale: float | None = None    # the score scale the layer declares (None: 1/sqrt(d_qk) is expected)
    scale_source: str = ""        # where that scale is declared, for the report
    softcap: float | None = None  # the score softcap the layer declares (scores are cap * tanh(scores / cap))
    precision: torch.dtype | None = None  # the layer computes in this dtype (e.g. softmax upcast), if lower
    n_heads: int | None = None
    n_kv_heads: int | None = None
    d_head: int | None = None
    no_heads_reason: str = ""     # why heads are not exposed, where the adapter knows (head_independence says it)
    qk_inferred: bool = False     # qk() rebuilds q, k from the projections, and the layer may transform them further
    qk_steps: tuple[str, ...] = ()  # what the layer has that may act on q or k before the scores (its q_norm, ...)
    v_steps: tuple[str, ...] = ()   # what it has that may act between its values and W_O (a value norm, a gate)
    d_out: int | None = None      # the output's width when not d_model (W_O outside the layer: h * d_h)
    unconfirmed: frozenset[str] = frozenset()       # keywords it may take through **kwargs: see confirm_keywords
    ignored_keywords: frozenset[str] = frozenset()  # keywords the layer took and ignored (said in the report)

    def run(self, x: torch.Tensor, *, keep: torch.Tensor | None = None, causal: bool | None = None,
            positions: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def run_weights(self, x: torch.Tensor, *, keep: torch.Tensor | None = None,
                    causal: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Queries and keys as the scores see them (after rotary), or None when not exposed."""
        return None

    def values(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each K/V head's values, as the contexts read them, or None when not exposed."""
        return None

    def contexts(self, x: torch.Tensor, *, causal: bool | None = None) -> torch.Tensor:
        raise NotImplementedError

    def values_and_contexts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each K/V head's values and each head's context made of them, for ``softmax_sanity`` to compare with the
        weights (``x`` unpadded, causal as the layer claims), or None where values are not exposed. Default:
        :meth:`values` and :meth:`contexts` (W_O's input); an adapter that sees both where the weights meet the
        values (Hugging Face's attention function) reads them there."""
        v = self.values(x)
        return None if v is None else (v, self.contexts(x))

    def position_bias(self, s: int) -> torch.Tensor | None:
        """The bias the layer adds to its scores from token positions alone, or None: T5's relative position bias,
        read off the adapter's ``attention`` or ``module`` by that family's convention (``compute_bias``). The
        check cannot move it with permuted tokens, and the scale is fitted on the scores without it."""
        return relative_bias(getattr(self, "attention", None) or getattr(self, "module", None), s)

    def head_slices(self, which: str, index: int) -> list[Slice]:
        """The parameter slices of query head ``index`` (``which="q"``) or K/V head ``index`` ("k"/"v")."""
        raise NotImplementedError

    def decode(self, x: torch.Tensor, prefill: int) -> torch.Tensor:
        """Causal outputs of ``x`` computed as a prefill of ``prefill`` tokens, then one token at a time."""
        raise NotImplementedError

    def converted(self, dtype: torch.dtype | None) -> "Adapter | None":
        """The same layer in ``dtype`` (None: its own): a deep copy of this adapter whose modules (its
        ``nn.Module`` attributes) are converted, in eval mode and without the caller's hooks, so that the check's
        writes (perturbed heads) and runs leave the caller's tensors as they were. None where it cannot be copied
        and exposes no heads (nothing is written into it); ``TypeError`` where it exposes heads."""
        return copy_held(self, dtype)

    def confirm_keywords(self, x: torch.Tensor) -> "Adapter":
        """This adapter, or a copy that also uses the keywords the layer may take (a forward with ``**kwargs``)
        where running it on ``x`` shows that it honours them. The driver calls it on the working copy."""
        return self

    @property
    def dtype(self) -> torch.dtype:
        return torch.get_default_dtype()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def causal_flag(self, causal: bool | None) -> bool:
        causal = self.claims_causal if causal is None else causal
        if causal != self.claims_causal and not self.accepts_causal:
            raise ValueError(f"{self.name} cannot be run with causal={causal}")
        return causal

    @contextlib.contextmanager
    def perturbed(self, which: str, index: int, generator: torch.Generator) -> Iterator[None]:
        """Add noise to one head's W_Q (or W_K / W_V) and biases; restore them afterwards."""
        slices = self.head_slices(which, index)
        saved = [t.detach().clone() for t, *_ in slices]
        try:
            with torch.no_grad():
                for t, dim, start, stop in slices:
                    part = t.narrow(dim, start, stop - start)
                    noise = torch.randn(part.shape, generator=generator, dtype=torch.float64)
                    scale = float(t.detach().double().std()) if t.numel() > 1 else 1.0
                    part.add_((noise * (scale or 1.0)).to(part.dtype).to(part.device))
            yield
        finally:
            with torch.no_grad():
                for (t, *_), old in zip(slices, saved):
                    t.copy_(old)


def _callable_name(obj: Any) -> str:
    name = getattr(obj, "__name__", None) or type(obj).__name__
    return str(name)


def causal_keep(s: int, device: torch.device) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool, device=device).tril()  # (s, s) True = may attend


_KEYWORD_OF = {flag: keyword for keyword, flag in FLAGS.items()}


class CallableAdapter(Adapter):
    """Any ``f(x) -> y``. ``causal=True`` declares that ``f`` is causal. If ``f`` takes ``mask=``,
    ``causal=`` or ``return_weights=`` keywords they are used with headwise's meaning; through ``**kwargs``
    only where it honours them (:meth:`confirm_keywords`). A flag set after construction (``accepts_mask = False``
    in a subclass's ``__init__``) settles its keyword: it is used as set, never probed.

    Shapes:
        f: (b, s, d) -> (b, s, d); mask (b, 1, 1, s) bool True = may attend; weights (b, h, s, s)

    Example:
        >>> ad = CallableAdapter(lambda x: 2 * x, d_model=4)
        >>> ad.run(torch.ones(1, 2, 4)).sum().item()
        16.0
    """

    def __init__(self, fn: Callable, *, d_model: int, causal: bool = False, name: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"layer must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.d_model = d_model
        self.name = name or _callable_name(fn)
        self.claims_causal = causal
        kw, self.open_keywords = signature_keywords(getattr(fn, "forward", fn))
        self.accepts_mask = "mask" in kw
        self.accepts_causal = "causal" in kw
        self.exposes_weights = "return_weights" in kw
        # only through **kwargs: candidates until confirm_keywords has seen the layer honour them
        self.unconfirmed = frozenset({"mask", "causal", "return_weights"} - kw if self.open_keywords else ())

    def __setattr__(self, name: str, value: Any) -> None:
        # A keyword's flag set after the signature was read (by a subclass's __init__, or its user on the instance)
        # is their decision, True or False: a False is often deliberate (a mask of the opposite convention), so the
        # keyword stops being a candidate that confirm_keywords would probe and take
        keyword = _KEYWORD_OF.get(name)
        if keyword is not None and keyword in self.__dict__.get("unconfirmed", ()):
            super().__setattr__("unconfirmed", self.unconfirmed - {keyword})
        super().__setattr__(name, value)

    def confirm_keywords(self, x):
        return confirmed(self, x)

    def _kwargs(self, keep, causal) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        causal = self.causal_flag(causal)
        if self.accepts_causal:
            kw["causal"] = causal
        if keep is not None:
            if not self.accepts_mask:
                raise ValueError(f"{self.name} takes no mask")
            kw["mask"] = keep[:, None, None, :]  # (b, 1, 1, s)
        return kw

    def run(self, x, *, keep=None, causal=None, positions=None):
        if positions is not None:
            raise ValueError(f"{self.name} takes no positions")
        return self.fn(x, **self._kwargs(keep, causal))

    def run_weights(self, x, *, keep=None, causal=None):
        return self.fn(x, return_weights=True, **self._kwargs(keep, causal))


def check_rotary_scaling(rotary: Any, where: str) -> None:
    """``ValueError`` if a rotary embedding multiplies cos and sin by a non-finite ``attention_scaling``: every
    query and key would be NaN, and no property could say anything about the layer."""
    scaling = getattr(rotary, "attention_scaling", None)
    if scaling is None:
        return
    try:
        finite = math.isfinite(float(scaling))
    except (TypeError, ValueError):
        finite = False
    if not finite:
        raise ValueError(f"{where}: its rotary embedding's attention_scaling must be a finite number, got {scaling!r}")


def split(t: torch.Tensor, n: int) -> torch.Tensor:
    b, s, width = t.shape
    return t.reshape(b, s, n, width // n).transpose(1, 2)  # (b, n, s, d_h)


@contextlib.contextmanager
def capture_input(module: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Record the first positional input of ``module`` (e.g. W_O's input: the merged head contexts)."""
    got: list[torch.Tensor] = []
    handle = module.register_forward_pre_hook(lambda mod, args: got.append(args[0]))
    try:
        yield got
    finally:
        handle.remove()
