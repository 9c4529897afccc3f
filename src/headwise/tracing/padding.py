"""The real tokens of a traced model call, read off the ``attention_mask`` it was given (:func:`padding_of`):
what "mean" edits and :meth:`LayerRecord.mean` average over.

A 2-D mask is (b, s), column j position j. A 4-D one (``generate`` with a static cache passes (b, 1, s_q, s_kv))
is read back into that form where it shows the real tokens exactly; otherwise the call's padding is
:class:`~headwise.tracing.edits.UnknownPadding`, which every mean refuses.

Shapes:
    b: batch, s: positions, s_q: this call's queries, s_kv: its keys, h: heads.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Mapping

import torch
from torch import nn

from .edits import CachePadding, DeferredPadding, OtherSequence, UnknownPadding, Unseen

__all__ = ["padding_of", "padding_of_4d", "reads", "position_of", "takes", "watch_hosts", "ReachedMask",
           "InertWhenCopied", "inert_hook", "MASK_NAMES", "CROSS_NAMES"]

#: What an attention module's forward calls the padding mask that reaches it, in the families of transformers
#: 5.24: most ``attention_mask``; T5 and its kin (mT5, UMT5, LongT5, Switch Transformers, Pop2Piano, UDOP)
#: ``mask``. Others (``attn_mask`` of ``nn.MultiheadAttention``: True there masks) are not padding masks.
MASK_NAMES = ("attention_mask", "mask")
#: What such a forward calls the other sequence its keys and values are read from, given (not None) only in a
#: cross-attention call: BART's and T5's ``key_value_states``, BERT's and GPT-2's ``encoder_hidden_states``.
CROSS_NAMES = ("key_value_states", "encoder_hidden_states")


def reads(mask: torch.Tensor) -> torch.Tensor | None:
    """Which keys each query row may read, (b, s_q, s_kv) bool, from a (b, 1 or h, s_q, s_kv) or (b, s_q, s_kv)
    mask: bool True = read, floating 0 = read and large negative = masked, integer nonzero = read. None where a
    floating mask holds other values (a bias, not a mask)."""
    if mask.is_floating_point():
        read, masked = mask == 0, mask < -1e3  # -inf, finfo.min (Hugging Face) and the older -1e4 all mask
        if not (read | masked).all():
            return None
    else:
        read = mask != 0
    return read.any(1) if read.dim() == 4 else read  # any head: the positions are shared by every head


def padding_of_4d(mask: torch.Tensor, name: str) -> torch.Tensor | CachePadding | UnknownPadding:
    """The (b, S) real-token mask equivalent to a 2-D ``attention_mask`` (column j is position j, this call's
    queries its last s_q columns) for a call given a (b, [h,] s_q, s_kv) mask, as ``generate`` passes with a
    static cache; or :class:`UnknownPadding` where the mask does not show it exactly.

    A key is real when some query row may read it. A query's position is found from the causal structure (each
    real row reads its own key last; padded rows read nothing, as transformers' masks leave them fully masked:
    an unmasked padded row reads past its own position, which the causal check catches unless it is the call's
    last row); without a cache (s_q == s_kv) a bidirectional mask, where every row that reads reads the same
    keys, gives the keys' positions."""
    read = reads(mask)
    if read is None:
        return UnknownPadding(f"the model's {name} holds values other than 0 and large negative ones")
    _, s_q, s_kv = read.shape
    keys, rows = read.any(1), read.any(2)  # (b, s_kv), (b, s_q)
    if s_kv == 0 or s_q == 0:  # nothing to locate (and no row to take a maximum over)
        return keys if s_q == s_kv else UnknownPadding(f"the model's {name} is {tuple(mask.shape)}")
    cols = torch.arange(s_kv, device=read.device)
    last = torch.where(read, cols, -1).amax(2) - torch.arange(s_q, device=read.device)  # (b, s_q): position - i
    offsets = last[rows].unique()
    if offsets.numel() <= 1:
        base = int(offsets[0]) if offsets.numel() else s_kv - s_q  # no real row: every position is padding
        positions = base + torch.arange(s_q, device=read.device)
        causal = 0 <= base <= s_kv - s_q and not (read & (cols > positions[:, None])).any()
        if causal and torch.equal(keys[:, base:base + s_q], rows):  # a query is real as its own key is
            return CachePadding(keys[:, :base + s_q])
    if s_q == s_kv and ((read == keys[:, None, :]) | ~rows[:, :, None]).all():
        return keys
    return UnknownPadding(f"the model's {name} {tuple(mask.shape)} is neither a causal nor a "
                          "bidirectional padding mask")


def padding_of(args: tuple, kwargs: dict, name: str, at: int | None,
               defer: bool = False) -> torch.Tensor | CachePadding | UnknownPadding | ReachedMask | None:
    """A call's (b, s) real-token mask passed as ``name`` (by keyword, or by position ``at``), or None.

    A 4-D (or 3-D) mask gives the 2-D one it stands for, so "mean" never silently averages over padding or a
    static cache's empty slots; a mask that does not show the real tokens exactly gives
    :class:`UnknownPadding`, which "mean" refuses. With ``defer`` such a mask is kept, as a copy, in a
    :class:`ReachedMask`, read only when a mean needs it: reading it is data-dependent, which a call compiled
    with ``fullgraph=True`` cannot trace."""
    mask = _given(args, kwargs, name, at)
    if isinstance(mask, Mapping):  # a mask per layer type (sliding, full): each layer's keys differ
        return UnknownPadding(f"the model's {name} is a dict of masks per layer type ({sorted(map(str, mask))})")
    if not isinstance(mask, torch.Tensor):
        return None
    if mask.dim() == 2:
        return mask != 0
    if mask.dim() in (3, 4):
        return ReachedMask(mask.clone(), name) if defer else padding_of_4d(mask, name)
    return UnknownPadding(f"the model's {name} has {mask.dim()} dimensions, not 2 (b, s) or 4 (b, h, s_q, s_kv)")


def position_of(name: str, module: nn.Module) -> int | None:
    """The position of ``module.forward``'s parameter ``name`` among the positional ones, or None."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional.index(name) if name in positional else None


def takes(name: str, module: nn.Module) -> bool:
    """Whether ``module.forward`` has a parameter ``name`` (by position or keyword)."""
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


class ReachedMask(DeferredPadding):
    """A mask (or None) kept as given, read into real tokens on the first :meth:`resolve`: the traced model's
    3-D or 4-D ``attention_mask``, or the mask (``name``, one of :data:`MASK_NAMES`) that reached a patched
    layer in a call the trace's pre-hook did not see."""

    __slots__ = ("mask", "name", "done", "read")

    def __init__(self, mask: torch.Tensor | None, name: str = "attention_mask") -> None:
        self.mask, self.name, self.done, self.read = mask, name, False, None

    def resolve(self) -> torch.Tensor | CachePadding | UnknownPadding | None:
        if not self.done:  # once per call, however many layers and heads take a mean over it
            self.read = padding_of((), {self.name: self.mask}, self.name, None)
            # a record keeps the (b, S) tokens from here on, never the (b, 1, s_q, s_kv) mask
            self.mask, self.done = None, True
        return self.read


def inert_hook(*args: Any) -> None:
    """What a copied module keeps of a trace's hooks: nothing that runs or refers to the trace."""
    return None


def _inert() -> Any:
    return inert_hook


class InertWhenCopied:
    """A trace's hook on a user's module: a copy of the module (``copy.deepcopy``, ``copy.copy``, pickling)
    keeps :func:`inert_hook` in its place, never the trace."""

    def __deepcopy__(self, memo: dict) -> Any:
        return inert_hook

    def __copy__(self) -> Any:
        return inert_hook

    def __reduce__(self) -> Any:
        return (_inert, ())


_BLIND = "the traced module takes no attention_mask"


class _HostMask(InertWhenCopied):
    """A pre-hook (``before``) or post-hook on a patched layer's host module: the mask the module is given as
    ``name`` is what reaches the layer during that call, and nothing after it (a later call never reads it);
    in a cross-attention call (the module's ``is_cross_attention``, or one of ``cross``, (name, position) of
    :data:`CROSS_NAMES`, given) it is the other sequence's, so the layer gets ``refuse`` instead. A copy of the
    host (``copy.deepcopy``, pickling) keeps :func:`inert_hook` in its place."""

    def __init__(self, entry: Any, name: str, at: int | None, before: bool, cross: tuple = (),
                 refuse: Unseen | None = None, other: OtherSequence | None = None) -> None:
        self.entry, self.name, self.at, self.before = entry, name, at, before
        self.cross, self.refuse, self.other = cross, refuse, other

    def __call__(self, module: nn.Module, args: tuple, more: Any) -> None:
        if not self.before:
            self.entry.reached = self.entry.key_padding = None
            return
        if getattr(module, "is_cross_attention", False) is True or any(
                _given(args, more, n, at) is not None for n, at in self.cross):
            # its keys are the other sequence's in any model (BERT or GPT-2 with add_cross_attention too, not only
            # an encoder-decoder), whatever padding its queries have
            self.entry.reached, self.entry.key_padding = self.refuse, self.other
            return
        mask = _given(args, more, self.name, self.at)
        self.entry.reached = ReachedMask(mask, self.name) if mask is None or isinstance(mask, torch.Tensor) else \
            Unseen(f"the {self.name} reaching layer {self.entry.record.index} is a {type(mask).__name__}")


def _given(args: tuple, kwargs: Any, name: str, at: int | None) -> Any:
    """The argument ``name`` of a call, by keyword or at position ``at``; None when not given."""
    value = kwargs.get(name) if isinstance(kwargs, dict) else None
    if value is None and at is not None and len(args) > at:
        value = args[at]
    return value


def watch_hosts(layers: list, entries: list, unseen: Unseen | None = None, blind: bool = False) -> list:
    """Hooks that let each entry read the mask reaching its layer, for the layers of a patched Hugging Face
    model (views with a ``host`` module whose forward takes one of :data:`MASK_NAMES`): the padding of a call
    made past the traced model's own forward (``model.forward``, ``torch.compile(model.forward)``, a submodule,
    T5's encoder under ``generate``), which the trace's pre-hook never sees, or of every call where the traced
    module takes no mask (``blind``: one patched layer, a plain wrapper). A view whose host takes none of them
    gets ``unseen`` (the trace's refusal) saying so, and so does each cross-attention call of a host (decided
    per call: a decoder's self-attention reads its own sequence's mask). Returns the hook handles."""
    views = sys.modules.get("headwise.interop.views")  # only a patched model has hosts (interop imported)
    why = unseen.why if unseen is not None else _BLIND
    handles = []
    for (_, layer), entry in zip(layers, entries):
        host = getattr(layer, "host", None) if views is not None and isinstance(layer, views.LayerView) else None
        if host is None:
            continue
        name = next((n for n in MASK_NAMES if takes(n, host)), None)
        if name is None:
            if unseen is not None or blind:  # read only while the trace's own padding is unseen (Entry.padding)
                entry.reached = Unseen(f"{why}, and layer {entry.record.index}'s module {type(host).__name__}"
                                       f".forward takes none of {list(MASK_NAMES)}, the parameters a layer's mask "
                                       "is read from")
            continue
        cross = tuple((n, position_of(n, host)) for n in CROSS_NAMES if takes(n, host))
        # one object for every such call, so compiled code guarding on it sees the same one at every step
        refuse = Unseen(f"{why}, and layer {entry.record.index}'s module {type(host).__name__} was called as "
                        "cross-attention, whose mask is the other sequence's (the encoder's), not its queries'; "
                        "trace the whole model")
        other = OtherSequence(f"layer {entry.record.index}'s module {type(host).__name__} was called as "
                              "cross-attention, whose keys are another sequence's (the encoder's) tokens, not those "
                              "of the attention_mask the trace read")
        at = position_of(name, host)
        handles.append(host.register_forward_pre_hook(_HostMask(entry, name, at, True, cross, refuse, other),
                                                      with_kwargs=True))
        handles.append(host.register_forward_hook(_HostMask(entry, name, at, False), always_call=True))
    return handles
