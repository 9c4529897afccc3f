"""A trace session: :class:`Trace` (the context manager) and :func:`trace`.

Shapes:
    b: batch, s: sequence, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from ..attention import MultiHeadAttention
from .checkpointing import refuse_checkpointing, switches
from .edits import SITES, SitePlan, UnknownPadding, Unseen, parse_value
from .layers import find_layers, in_place, w_o_adapter
from .padding import InertWhenCopied, ReachedMask, inert_hook, padding_of, position_of, takes, watch_hosts
from .record import CAPTURABLE, LayerRecord, TraceLookupError
from .tracer import Entry, LayerTracer, watch_w_o

__all__ = ["Trace", "trace"]


def _decoder_layers(module: nn.Module, layers: list) -> tuple[frozenset[int], bool]:
    """The traced layers inside the decoder of an encoder-decoder model (``config.is_encoder_decoder``), and
    whether their queries' padding is ``module``'s ``decoder_attention_mask`` (False when ``module`` is the
    decoder itself: then its own ``attention_mask`` is)."""
    get = getattr(module, "get_decoder", None)
    if getattr(getattr(module, "config", None), "is_encoder_decoder", False) is not True or not callable(get):
        return frozenset(), False
    try:
        decoder = get()
    except (AttributeError, NotImplementedError, TypeError):
        return frozenset(), False
    if decoder is module:
        return frozenset(range(len(layers))), False
    prefix = next((name for name, m in module.named_modules() if m is decoder and name), None)
    if prefix is None:
        return frozenset(), False
    return frozenset(i for i, (name, _) in enumerate(layers) if name.startswith(prefix + ".")), True


def _global_heads(layer: MultiHeadAttention) -> tuple[int, tuple[int, ...] | None]:
    """(the unsharded layer's query heads, the global indices of this rank's heads in local order) for a
    layer split by heads (:func:`headwise.parallel.tensor_parallel`); (n_heads, None) for any other layer."""
    from ..parallel.tensor import TensorParallelAttention  # torch.distributed loads only for a sharded layer

    if isinstance(layer, TensorParallelAttention):
        return layer.global_config.n_heads, tuple(layer.partition.q_heads)
    return layer.n_heads, None


def _width(layer: MultiHeadAttention, site: str) -> int | None:
    """A head's ``site`` width where known before a call (d_h); None for q and k of a patched module whose Q/K
    are not located (multi-head latent attention's are wider than v): each call's slice decides there."""
    located = getattr(layer, "located", None)  # a patched Hugging Face layer's: {projection: "" or why not}
    unsure = site in ("q", "k") and isinstance(located, Mapping) and any(located.get(p) for p in ("q_proj", "k_proj"))
    return None if unsure else layer.d_head


# What models pickled inside a trace by earlier versions name in place of the trace's hook.
inert = inert_hook


def _inert() -> Any:
    return inert_hook


class _BeforeCall(InertWhenCopied):
    """The trace's forward pre-hook (and, with ``after``, post-hook) on the traced module. It refers to its trace
    weakly; a copy of the module keeps an inert hook in its place (:class:`InertWhenCopied`)."""

    def __init__(self, session: "Trace", after: bool = False) -> None:
        self.session = weakref.ref(session)
        self.after = after  # the post-hook: the call's padding ends with it

    def __call__(self, module: nn.Module, args: tuple, kwargs: Any) -> None:
        session = self.session()
        if session is not None and session._active and module is session.module:
            if self.after:
                session._after_call()
            else:
                session._before_call(module, args, kwargs)


class Trace:
    """A running (or finished) trace: ``t[i]`` / ``t["transformer.h.0.attn"]`` is a :class:`LayerRecord`.

    Use it as a context manager (see :func:`trace`); it is indexed like :func:`find_layers` (position,
    negative positions, or the layer's module name).
    """

    def __init__(self, module: nn.Module, capture: Any = (), edit: Mapping | None = None) -> None:
        self.module = module
        self.layers = find_layers(module)
        self._names = {name: i for i, (name, _) in enumerate(self.layers)}
        per_layer = self._parse_capture(capture)
        self.records = [LayerRecord(i, n, m, per_layer.get(i, frozenset())) for i, (n, m) in enumerate(self.layers)]
        # An encoder-decoder's decoder layers: queries from the decoder's tokens, keys from either sequence.
        self._decoder, self._reads_decoder_mask = _decoder_layers(module, self.layers)
        for i in self._decoder:
            self.records[i].decoder = True
        self._plans = self._parse_edits(edit)
        self._active = False
        self._thread: int | None = None  # the thread that entered it
        self._hooks: list = []
        self._switches: list = []  # the gradient-checkpointing flags around traced layers (checkpointing.py)
        self._mask_at: int | None = None
        self._decoder_mask_at: int | None = None
        # Outside a call of the module itself (model.forward, a compiled model.forward, a submodule) its masks
        # are unseen: one object, so compiled code guarding on it sees the same one at every step.
        self._unseen: Unseen | None = None
        #: The real-token mask ((b, s) bool) of the model call running now, from its ``attention_mask`` (None
        #: without one; :class:`UnknownPadding` where the mask does not show it exactly; a 3-D or 4-D mask as a
        #: :class:`~headwise.tracing.padding.ReachedMask`, read when a mean first needs it; outside a call of the
        #: module itself, for a module taking an ``attention_mask``, an :class:`~headwise.tracing.edits.Unseen`).
        self.padding: torch.Tensor | UnknownPadding | ReachedMask | None = None
        #: The decoder's real-token mask of an encoder-decoder call: its ``decoder_attention_mask`` (read as
        #: ``padding``), or None.
        self.decoder_padding: torch.Tensor | UnknownPadding | ReachedMask | None = None

    # -- indexing ----------------------------------------------------------------------------------------
    def index(self, ref: Any) -> int:
        """The position of a layer given by position, module name or the layer object itself."""
        n = len(self.layers)
        if isinstance(ref, MultiHeadAttention):
            for i, (_, m) in enumerate(self.layers):
                if m is ref:
                    return i
            raise TraceLookupError("that MultiHeadAttention is not one of the traced layers")
        if isinstance(ref, str):
            if ref not in self._names:
                raise TraceLookupError(f"no traced layer is named {ref!r}; the layers are {list(self._names)}")
            return self._names[ref]
        if isinstance(ref, bool) or not isinstance(ref, int):
            raise TypeError(f"a layer is given by position (int), module name (str) or the layer itself, "
                            f"got {type(ref).__name__}")
        if not -n <= ref < n:
            raise IndexError(f"layer position must be in [-{n}, {n}) for these {n} layers, got {ref}")
        return ref % n

    def __getitem__(self, ref: Any) -> LayerRecord:
        return self.records[self.index(ref)]

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[LayerRecord]:
        return iter(self.records)

    def as_dict(self, call: int | None = None) -> dict[str, torch.Tensor]:
        """Every capture under its TransformerLens hook name (a porting aid), in TransformerLens' layouts:
        ``blocks.{l}.attn.hook_q`` / ``hook_k`` / ``hook_v`` (b, s, heads, d_h), ``hook_pattern``
        (b, h, s_q, s_kv), ``hook_z`` (b, s_q, h, d_h), ``hook_result`` (b, s_q, h, d); in a layer with rotary
        embeddings q and k are ``hook_rot_q`` / ``hook_rot_k`` (after the rotation, as captured). Layers not
        called are left out.

        ``call``: one call's captures (``t[l].calls[call]``, e.g. one decoding step), in every layer called that
        often; None joins every call as ``t[l].get`` does, refused (``ValueError``) for what does not join."""
        if call is not None and (isinstance(call, bool) or not isinstance(call, int)):
            raise TypeError(f"as_dict: call must be an int (a call's position) or None, got {type(call).__name__}")
        out = {}
        for record in self.records:
            calls = record.calls
            if not calls or (call is not None and not -len(calls) <= call < len(calls)):
                continue
            for name, what in record.tl_names().items():
                t = record.get(what) if call is None else calls[call][what]
                out[name] = t.transpose(1, 2) if what in ("q", "k", "v") else t
        return out

    @property
    def materializes_probabilities(self) -> list[str]:
        """Names of the layers whose probabilities this trace materialises (capturing or editing ``pattern``)."""
        return [r.name for r, p in zip(self.records, self._plans) if "pattern" in r.capture or p["pattern"]]

    def __repr__(self) -> str:
        eager = self.materializes_probabilities
        edited = sum(1 for plans in self._plans if any(plans.values()))
        return (f"Trace({len(self.records)} layers, edits on {edited} layers, "
                + (f"materialises probabilities (eager path) in {eager})" if eager else "fused path kept)"))

    # -- the context manager -----------------------------------------------------------------------------
    def __enter__(self) -> "Trace":
        if self._active:
            raise RuntimeError("this trace is already active")
        current = [layer.__dict__.get("tracer") for _, layer in self.layers]
        foreign = [n for (n, _), t in zip(self.layers, current) if t is not None and not isinstance(t, LayerTracer)]
        if foreign:
            raise RuntimeError(f"layers {foreign} carry a tracer that is not a headwise trace")
        # A layer's traces see every call of it, from any thread: a trace open in another thread would apply its
        # edits to this thread's calls and record them (and this one theirs). Checked here, never per call.
        me = threading.get_ident()
        shared = [i for i, t in enumerate(current)
                  if t is not None and any(e.session._thread != me for e in t.entries)]
        if shared:
            raise ValueError(f"trace: layers {shared} (of {len(current)}) have a trace open that another thread "
                             "entered; a trace sees every call of its layers from any thread, so two threads' "
                             "traces would edit and record each other's calls: trace from one thread at a time "
                             "(or trace a copy of the model per thread)")
        w_o = []  # the module applying each layer's W_O where 'result' is taken at its call (watch_w_o), or None
        for (name, layer), record in zip(self.layers, self.records):
            adapter = w_o_adapter(layer) if "result" in record.capture else None
            w_o.append(watch_w_o(layer, f"layer {record.index} ({name!r})") if "result" in record.capture else None)
            if adapter is not None:
                raise ValueError(f"trace: capture 'result' of layer {record.index} ({name or type(layer).__name__}) "
                                 f"computes each head's write from W_O's weight, but W_O is wrapped by an adapter "
                                 f"({type(adapter).__module__}.{type(adapter).__qualname__}, PEFT) whose delta is "
                                 "not in that weight; merge_and_unload() first, "
                                 "or capture 'z' and apply W_O (the adapter included) yourself")
        flags = switches(self.module, self.layers)
        refuse_checkpointing(self.module, flags)
        blind = not takes("attention_mask", self.module)  # its layers read the mask that reaches them, if any
        entries = []
        for (name, layer), tracer, record, plans, out in zip(self.layers, current, self.records, self._plans, w_o):
            if tracer is None:
                tracer = layer.tracer = LayerTracer()
            if out is not None:
                tracer.watch(layer, out, f"layer {record.index} ({name!r})")
            record.clear()
            entries.append(Entry(self, record, plans, decoder=record.index in self._decoder, blind=blind))
            tracer.entries.append(entries[-1])
        self._mask_at = position_of("attention_mask", self.module)
        self._decoder_mask_at = position_of("decoder_attention_mask", self.module)
        self._unseen = None if blind else Unseen(
            f"{type(self.module).__name__} was run past its own call (model.forward, torch.compile(model.forward) "
            "or a submodule), so the trace never saw its attention_mask")
        self.padding = self.decoder_padding = self._unseen
        self._thread, self._switches = me, flags
        self._hooks = [self.module.register_forward_pre_hook(_BeforeCall(self), with_kwargs=True),
                       self.module.register_forward_hook(_BeforeCall(self, after=True), always_call=True),
                       *watch_hosts(self.layers, entries, self._unseen, blind)]
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        for _, layer in self.layers:
            tracer = layer.__dict__.get("tracer")
            if isinstance(tracer, LayerTracer):
                tracer.entries = [e for e in tracer.entries if e.session is not self]
                if not tracer.entries:
                    tracer.close()
                    del layer.__dict__["tracer"]  # back to the class default (None)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.padding = self.decoder_padding = None
        self._active = False

    def _after_call(self) -> None:
        """After each call of the traced module (failed ones too): its padding is never a later call's."""
        self.padding = self.decoder_padding = self._unseen

    def _before_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Before each call of the traced module: its layers are still the traced ones, and its
        ``attention_mask`` (if any) is this call's padding, its ``decoder_attention_mask`` its decoder's."""
        refuse_checkpointing(module, self._switches)  # turned on inside the trace
        compiling = torch.compiler.is_compiling()
        if compiling:  # Dynamo cannot trace find_layers' walk: one path per traced layer
            for name, layer in self.layers:
                if not in_place(module, name, layer):
                    self._changed()
        elif not isinstance(module, MultiHeadAttention):  # eagerly the whole walk: added layers are caught too
            now = find_layers(module)
            if len(now) != len(self.layers) or any(a is not b for (_, a), (_, b) in zip(now, self.layers)):
                self._changed()
        # Compiled code cannot read a 3-D or 4-D mask (data-dependent) and need not unless a mean asks: there it
        # is kept, as a copy (the caller may refill its buffer for the next call), and read when a mean needs it.
        self.padding = padding_of(args, kwargs, "attention_mask", self._mask_at, defer=compiling)
        self.decoder_padding = padding_of(args, kwargs, "decoder_attention_mask", self._decoder_mask_at,
                                          defer=compiling) if self._reads_decoder_mask else self.padding

    @staticmethod
    def _changed() -> None:
        raise RuntimeError("trace: the model's attention layers were replaced or added inside the trace (e.g. by "
                           "headwise.surgery, which re-patches them); the trace would miss them: close it and open "
                           "a new trace on the changed model")

    # -- arguments ---------------------------------------------------------------------------------------
    def _parse_capture(self, capture: Any) -> dict[int, frozenset[str]]:
        def names(value: Any) -> frozenset[str]:
            value = (value,) if isinstance(value, str) else value
            if not isinstance(value, (tuple, list, set, frozenset)):
                raise TypeError(f"capture takes names from {CAPTURABLE} (a tuple), got {type(value).__name__}")
            bad = [v for v in value if v not in CAPTURABLE]
            if bad:
                raise ValueError(f"capture: {bad} not capturable; choose from {CAPTURABLE}")
            return frozenset(value)

        if isinstance(capture, Mapping):
            # two keys can name one layer (0 and -n, an index and a name); keeping either would drop the other
            parsed: dict[int, frozenset[str]] = {}
            keys: dict[int, Any] = {}
            for ref, v in capture.items():
                li = self.index(ref)
                if li in parsed:
                    raise ValueError(f"capture: keys {keys[li]!r} and {ref!r} both name layer {li}; give each layer "
                                     f"once, with every name it captures")
                parsed[li], keys[li] = names(v), ref
            return parsed
        every = names(capture)
        return {i: every for i in range(len(self.layers))}

    def _parse_edits(self, edit: Mapping | None) -> list[dict[str, SitePlan]]:
        if edit is None:
            edit = {}
        if not isinstance(edit, Mapping):
            raise TypeError(f"edit must be a dict {{(layer, head): edit}}, got {type(edit).__name__}")
        # Heads are global: on a layer split by heads every rank parses and checks every edit alike (so a
        # bad one is refused on every rank), and keeps the heads it holds, at their local place.
        chosen: dict[tuple[int, int, str], Any] = {}
        for key, value in edit.items():
            ref, heads, site = self._key(key)
            li = self.index(ref)
            for head in self._heads(heads, _global_heads(self.layers[li][1])[0], key):
                if (li, head, site) in chosen:
                    raise ValueError(f"edit: {site} of head {head} of layer {li} is edited twice (key {key!r})")
                chosen[(li, head, site)] = value
        plans = [{s: SitePlan(layer.n_heads) for s in SITES} for _, layer in self.layers]
        for (li, head, site), value in sorted(chosen.items()):
            layer = self.layers[li][1]
            local = _global_heads(layer)[1]
            where = f"edit of layer {li} head {head} {site}"
            if isinstance(value, str) and value == "mean" and site in ("k", "v") and li in self._decoder:
                raise ValueError(f"{where}: 'mean' of k or v in a decoder layer of an encoder-decoder model is not "
                                 "supported: its keys are the decoder's tokens (self-attention) or the encoder's "
                                 "(cross-attention), so whose padding to average over is unknown; pass a tensor "
                                 "of the means instead")
            width = None if site == "pattern" else _width(layer, site)
            reference = None
            if site != "pattern":
                reference = (lambda value=value, li=li, head=head, site=site:  # noqa: E731
                             self._reference_mean(value[1], li, head, site))
            factor, fn = parse_value(value, site, where, width, li, head, reference)
            if local is None:
                plans[li][site].add(head, factor, fn)
            elif head in local:  # a head held by another rank is that rank's edit
                plans[li][site].add(local.index(head), factor, fn)
        return plans

    def _reference_mean(self, ref: Any, li: int, head: int, site: str) -> torch.Tensor:
        if not isinstance(ref, Trace) or len(ref) != len(self):
            raise TypeError(f"edit ('mean', reference): reference must be a finished headwise.trace of the same "
                            f"{len(self)} layers that captured {site!r}, got {type(ref).__name__}")
        means = ref[li].mean(site)  # (heads, d_h): over the reference's rows and real tokens
        h, _ = _global_heads(self.layers[li][1])
        ref_layer = ref[li].layer
        ref_h, ref_local = _global_heads(ref_layer)
        if ref_h != h:
            raise ValueError(f"edit ('mean', reference): layer {li} of the reference has {ref_h} heads, this "
                             f"layer {h}")
        if ref_local is None:  # a trace of a whole layer: its rows are global heads (or K/V heads)
            group = ref_layer.n_heads // ref_layer.n_kv_heads
            return means[head if means.shape[0] == ref_layer.n_heads else head // group]
        if head not in ref_local:
            if _global_heads(self.layers[li][1])[1] is None:  # a whole layer would apply it: no mean to give
                raise ValueError(f"edit ('mean', reference): the reference traced a shard holding heads "
                                 f"{list(ref_local)} of layer {li}, not head {head}; take the reference on the "
                                 "rank holding it, or on the unsharded layer")
            # A trace of a shard that does not hold this head, for a shard that does not either: the edit is the
            # holding rank's, never applied here; zeros of the right width pass the same checks on every rank.
            return means.new_zeros(means.shape[-1])
        j = ref_local.index(head)  # its rows are the shard's heads (or the shard's K/V heads)
        group = ref_layer.n_heads // ref_layer.n_kv_heads
        return means[j if means.shape[0] == ref_layer.n_heads else j // group]

    @staticmethod
    def _key(key: Any) -> tuple[Any, Any, str]:
        if not isinstance(key, tuple):
            return key, None, "z"
        if len(key) == 2:
            return key[0], key[1], "z"
        if len(key) == 3:
            if key[2] not in SITES:
                raise ValueError(f"edit key {key!r}: the site must be one of {SITES}, got {key[2]!r}")
            return key
        raise ValueError(f"edit keys are layer, (layer, head), (layer, (heads...)) or (layer, head, site); "
                         f"got {key!r}")

    @staticmethod
    def _heads(heads: Any, h: int, key: Any) -> list[int]:
        if heads is None:
            return list(range(h))
        items = list(heads) if isinstance(heads, (tuple, range)) else [heads]
        for i in items:
            if isinstance(i, bool) or not isinstance(i, int):
                raise TypeError(f"edit key {key!r}: heads are ints, got {type(i).__name__}")
            if not -h <= i < h:
                raise IndexError(f"edit key {key!r}: head must be in [0, {h}), got {i}")
        return [i % h for i in items]


def trace(module: nn.Module, capture: Any = (), edit: Mapping | None = None) -> Trace:
    """Capture and edit every head of ``module``'s layers while its own forward runs (see :mod:`headwise.tracing`).

    Args:
        module: a :class:`MultiHeadAttention`, a module containing them, or a patched Hugging Face model.
        capture: names from :data:`CAPTURABLE` for every layer, or ``{layer: names}``.
        edit: ``{key: e}`` with key ``layer`` (every head's z), ``(layer, head)``, ``(layer, (h1, h2))``
            (z) or ``(layer, head, site)`` with site one of ``"q"``, ``"k"``, ``"v"``, ``"pattern"``,
            ``"z"`` (head may be a tuple of heads or None for all); ``e`` one of ``"zero"``, a number or a
            0-d tensor (scale), ``"mean"`` (each row's mean over its real tokens), ``("mean", reference)``
            (a finished trace's mean, see :meth:`LayerRecord.mean`), a replacement tensor ((n,), (s, n)
            or (b, s, n)) or a callable ``(x_h, layer, head) -> x_h``.

    Shapes:
        x_h: one head's slice: q, z (b, s_q, d_h); k, v (b, s_kv, d_h); pattern (b, s_q, s_kv)

    Example:
        >>> import torch, headwise
        >>> attn = headwise.MultiHeadAttention(d_model=16, n_heads=4)
        >>> with trace(attn, capture=("pattern",), edit={(0, 2, "pattern"): "zero"}) as t:
        ...     y = attn(torch.randn(1, 3, 16))
        >>> float(t[0].pattern[:, 2].abs().sum())
        0.0
    """
    return Trace(module, capture, edit)
