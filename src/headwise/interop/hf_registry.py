"""Where each Hugging Face family keeps its attention weights: one small :class:`Entry` per family.

:func:`headwise.interop.patch` takes over every attention module that calls transformers' attention interface
(see :mod:`~headwise.interop.hf_interface`). Tracing needs nothing else; heads as weight objects
(``attn.head(i)``), ``result`` captures and surgery need Q/K/V and W_O located, and this registry is the one place
that says where they are. A family without an entry uses :data:`DEFAULT` (the usual attribute names); adding a
family is one line in :data:`ENTRIES`.

Multi-head latent attention (DeepSeek-V2/V3, ``latent=``:class:`Latent`) has no projection of the module input per
head: each head's Q, K, V are rows of up-projections reading shared latents. Its ``attn.head(i)`` is a
:class:`~headwise.interop.hf_latent.LatentHead` (those rows, and the shared parts named as shared); ``result``
captures work (``o_proj`` is an ordinary W_O); surgery stays refused (Q/K/V are not projections of x).

Layouts of a fused Q/K/V projection (``qkv``, rows of the ``(out, in)`` weight):

* ``"blocks"``: every query head, then every key head, then every value head (Phi-3 ``qkv_proj``, ModernBERT
  ``Wqkv``, GPT-BigCode ``c_attn`` with multi-query).
* ``"per_head"``: head by head, each head's q, k, v rows together (GPT-NeoX ``query_key_value``).

Shapes:
    h: query heads, h_kv: key/value heads, d: model width, d_qk: query/key head width, d_v: value head width.

Example:
    >>> entry_for("phi3").qkv, entry_for("phi3").layout
    ('qkv_proj', 'blocks')
    >>> entry_for("some_new_family") is DEFAULT
    True
    >>> entry_for("deepseek_v3").latent.kv_up
    'kv_b_proj'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Entry", "Latent", "DEFAULT", "ENTRIES", "entry_for"]


@dataclass(frozen=True)
class Latent:
    """Where multi-head latent attention keeps its pieces (transformers' DeepSeek names): attributes of the module.

    Attributes:
        q_up: candidate names of the per-head query projection, first match wins: ``q_b_proj`` (reads the query
            latent) or ``q_proj`` (reads x, when the config's ``q_lora_rank`` is None); rows head by head, each
            ``[nope | rope]``.
        q_down, q_norm: the shared query down-projection and its norm (absent with ``q_proj``).
        kv_down: the shared ``kv_a_proj_with_mqa``, rows ``[kv latent (kv_rank) | the one rope key (rope)]``.
        kv_norm: the shared norm of the kv latent.
        kv_up: the per-head up-projection of the kv latent, rows head by head, each ``[k nope | v]``.
        nope, rope, d_v, kv_rank: the module's attribute names of those widths.
    """

    q_up: tuple[str, ...] = ("q_b_proj", "q_proj")
    q_down: str = "q_a_proj"
    q_norm: str = "q_a_layernorm"
    kv_down: str = "kv_a_proj_with_mqa"
    kv_norm: str = "kv_a_layernorm"
    kv_up: str = "kv_b_proj"
    nope: str = "qk_nope_head_dim"
    rope: str = "qk_rope_head_dim"
    d_v: str = "v_head_dim"
    kv_rank: str = "kv_lora_rank"


@dataclass(frozen=True)
class Entry:
    """Where one family's attention module keeps its projections and head sizes.

    Attributes:
        q, k, v: candidate attribute names of the separate Q, K, V projections (``nn.Linear``), first match wins.
        o: candidate names of W_O on the attention module itself.
        o_parent: candidate paths of W_O on the module's parent (BERT-style ``SelfOutput.dense``).
        qkv: the fused Q/K/V projection's name (then q, k, v are ignored), with its ``layout``.
        heads, kv_heads: names of the module's (or its config's) query / key-value head counts.
        d_v: names of the value head width (the width of each head's context).
        unlocated: why Q/K/V cannot be located as per-head slices of projections of x ("" when they can).
        latent: where multi-head latent attention keeps its pieces (None for every other family): heads are then
            :class:`~headwise.interop.hf_latent.LatentHead` objects.
    """

    q: tuple[str, ...] = ("q_proj", "query", "q", "q_lin")
    k: tuple[str, ...] = ("k_proj", "key", "k", "k_lin")
    v: tuple[str, ...] = ("v_proj", "value", "v", "v_lin")
    o: tuple[str, ...] = ("o_proj", "out_proj", "dense", "o", "out_lin", "Wo", "c_proj")
    o_parent: tuple[str, ...] = ("output.dense",)
    qkv: str | None = None
    layout: str = "split"
    heads: tuple[str, ...] = ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_attention_heads")
    kv_heads: tuple[str, ...] = ("num_key_value_heads", "kv_heads", "num_kv_heads", "n_kv_heads")
    d_v: tuple[str, ...] = ("v_head_dim", "head_dim", "head_size", "attention_head_size", "key_value_proj_dim",
                            "d_kv")
    unlocated: str = ""
    latent: Latent | None = None


DEFAULT = Entry()

_MLA = ("multi-head latent attention: each head's Q, K and V are rows of up-projections (q_b_proj, kv_b_proj) "
        "reading shared latents of x (q_a_proj, kv_a_proj_with_mqa and their norms), not slices of projections of "
        "x; attn.head(i) gives those rows (a LatentHead)")

#: model_type -> where its attention keeps Q/K/V and W_O (families not listed use DEFAULT); a callable gets the
#: module's config, for families whose layout depends on it.
ENTRIES: dict[str, Entry | Callable[[Any], Entry]] = {
    "phi3": Entry(qkv="qkv_proj", layout="blocks"),
    "gpt_neox": Entry(qkv="query_key_value", layout="per_head"),
    "persimmon": Entry(qkv="query_key_value", layout="per_head"),
    "ctrl": Entry(q=("Wq",), k=("Wk",), v=("Wv",)),
    "modernbert": Entry(qkv="Wqkv", layout="blocks"),
    "gpt_bigcode": lambda cfg: Entry(qkv="c_attn", layout="blocks" if cfg.multi_query else "per_head"),
    "codegen": Entry(unlocated="CodeGen's qkv_proj interleaves its heads over 4 model-parallel shards"),
    # Latent attention up-projects every query head's own K/V: the config's num_key_value_heads is not read.
    "deepseek_v2": Entry(unlocated=_MLA, kv_heads=(), latent=Latent()),
    "deepseek_v3": Entry(unlocated=_MLA, kv_heads=(), latent=Latent()),
    "glm4_moe_lite": Entry(unlocated=_MLA, kv_heads=(), latent=Latent()),
    "mistral4": Entry(unlocated=_MLA, kv_heads=(), latent=Latent()),
}


def entry_for(model_type: str | None, config: Any = None) -> Entry:
    """The registry entry of ``model_type`` (a config's ``model_type``; ``config`` for layouts that depend on
    it), or :data:`DEFAULT`."""
    entry = ENTRIES.get(model_type or "", DEFAULT)
    return entry if isinstance(entry, Entry) else entry(config)
