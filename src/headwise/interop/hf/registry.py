"""Where each Hugging Face family keeps its attention weights, and what else its attention does: one small
:class:`Entry` per family, the one place headwise recognises a family.

:func:`headwise.interop.patch` takes over every attention module that calls transformers' attention interface
(:mod:`~headwise.interop.hf.attention_function`). Tracing needs nothing else; heads as weight objects
(``attn.head(i)``), ``result`` captures, surgery, :func:`~headwise.interop.from_hf` / ``to_hf`` and
:func:`headwise.check` read this registry for where Q/K/V and W_O are, how they are laid out, and what the family
adds to plain attention (rotary, per-head QK-norm). A family without an entry uses :data:`DEFAULT` (the usual
attribute names); adding a family is one line in :data:`ENTRIES`.

A projection stored as transformers' ``Conv1D`` (weight ``(in, out)``: GPT-2) is recognised by its class and read
transposed, in every layout.

Multi-head latent attention (DeepSeek-V2/V3, ``latent=``:class:`Latent`) has no projection of the module input per
head: each head's Q, K, V are rows of up-projections reading shared latents. Its ``attn.head(i)`` is a
:class:`~headwise.interop.hf.latent.LatentHead` (those rows, and the shared parts named as shared); ``result``
captures work (``o_proj`` is an ordinary W_O); surgery stays refused (Q/K/V are not projections of x).

Layouts of a fused Q/K/V projection (``qkv``, rows of the ``(out, in)`` weight):

* ``"blocks"``: every query head, then every key head, then every value head (Phi-3 ``qkv_proj``, ModernBERT
  ``Wqkv``, GPT-2's Conv1D ``c_attn``, GPT-BigCode ``c_attn`` with multi-query).
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
    >>> entry_for("inkling2_text").not_heads
    ('Inkling2BlockAttentionResidual',)
    >>> entry_for("qwen3").qk_norm, entry_for("qwen3").rotary, entry_for("qwen3").standalone
    (('q_norm', 'k_norm'), True, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Entry", "Latent", "DEFAULT", "ENTRIES", "entry_for", "sliding_window_of"]


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
        cross_q: where a cross-attention module (its ``is_cross_attention`` true) keeps its queries instead: this
            separate projection, ``qkv`` then holding only K | V as blocks (GPT-2's ``q_attn``; layout
            ``"kv_blocks"``). Its keys and values read the encoder's states, so its layer does not run alone.
        heads, kv_heads: names of the module's (or its config's) query / key-value head counts.
        width: names of the model width d (on the module, then its config).
        d_v: names of the value head width (the width of each head's context).
        unlocated: why Q/K/V cannot be located as per-head slices of projections of x ("" when they can).
        latent: where multi-head latent attention keeps its pieces (None for every other family): heads are then
            :class:`~headwise.interop.hf.latent.LatentHead` objects.
        not_heads: class names of the family's modules that call the attention interface over something other
            than token heads (the axis they hand over as heads is not one); :func:`~headwise.interop.patch` gives
            them no layer, and they compute through headwise's implementation function as plain attention.
        rotary: the module rotates Q and K with the model's rotary embedding built from the config's
            ``rope_parameters`` (rotate-half over the first ``rotary_dim`` features of each head); the layer's
            ``rotary`` (and so ``attn.head(i)`` run alone) applies the same rotation. False: the layer has none
            (the family's rotary, if any, runs only in the module's forward).
        qk_norm: the names of the module's norms over each head's d_h features, applied to the split queries and
            keys before rotary (Qwen3); the layer and its heads apply them.
        standalone: projections, ``qk_norm``, ``rotary``, the module's ``scaling`` and a softmax are the module's
            whole attention, so the layer's own forward (``attn(x)``) and :func:`~headwise.interop.from_hf`'s
            copy compute what the module computes (masks aside: a sliding window lives in the model's mask).
            Elsewhere ``attn(x)`` is refused and the copy holds the weights only.
        dropout: names of the module's attention-dropout probability (a float, or an ``nn.Dropout``).
        causal_skip: the family's modules attend over more keys than the model's causal mask covers, which only
            sdpa's kernel ``is_causal`` handles (Dory's looped layers prepend the previous loop's keys): headwise's
            mask function keeps transformers' skip of a purely causal mask for it, as sdpa does (elsewhere every
            prefill's mask is materialised).
        names_sdpa: the family's modeling code decides something by the implementation's name ``"sdpa"`` (read
            off transformers' modeling files when this registry was written, never at run time): a model of it
            patched from sdpa still gets every prefill's mask materialised, since its code would not take the
            decision it takes under sdpa for a missing mask (Gemma 4 keeps a prefill's queries whole).

    :func:`headwise.check` also reads what the family declares in its config:

    Attributes:
        scale_fields: config fields whose ``value ** -0.5`` is the score scale (Gemma 2's ``query_pre_attn_scalar``).
        multiplier_fields: config fields that are the score scale itself (Granite's ``attention_multiplier``).
        softcap_fields: config fields holding the score softcap (Gemma 2's ``attn_logit_softcapping``).

    Surgery (:mod:`headwise.surgery` resizing the module in place) also reads:

    Attributes:
        set_heads, set_kv_heads, set_groups, set_inner, set_kv_inner: the module attributes its forward reads
            that surgery sets to h, h_kv, h / h_kv, h * d_h and h_kv * d_h (each only where the module has it as
            an int).
        config_heads, config_kv_heads, config_d_head: the config fields that hold h, h_kv and d_h, set when every
            layer agrees and the model class then rebuilds every weight shape from the config.
        config_read: the module's forward reads h / h_kv from the model's shared config (Phi-3 splits
            ``qkv_proj`` at ``config.num_attention_heads``): every layer must keep the same head counts.
        per_head: the module's parameters with one entry per query head (gpt-oss ``sinks``), taken along.
            Per-head state over d_h is found without names (Cohere's ``q_norm.weight`` (h, d_h), StableLM's
            ``q_layernorm.norms``: :meth:`~headwise.interop.hf.surgery.SurgerySeam.head_state`) and carried.
        q_side, kv_side: names (the first attribute of the path) of per-head state that follows the query /
            the K/V heads, read only where h == h_kv and a change makes them differ (refused for other names).
        after_o: the module's submodules that act on the model width after W_O (ALBERT's ``LayerNorm``), not on
            the heads' width (which would stop surgery).
        refuse: why surgery cannot resize this family although its projections are located ("" when it can).
    """

    q: tuple[str, ...] = ("q_proj", "query", "q", "q_lin")
    k: tuple[str, ...] = ("k_proj", "key", "k", "k_lin")
    v: tuple[str, ...] = ("v_proj", "value", "v", "v_lin")
    o: tuple[str, ...] = ("o_proj", "out_proj", "dense", "o", "out_lin", "Wo", "c_proj")
    o_parent: tuple[str, ...] = ("output.dense",)
    qkv: str | None = None
    layout: str = "split"
    cross_q: str | None = None
    heads: tuple[str, ...] = ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_attention_heads")
    kv_heads: tuple[str, ...] = ("num_key_value_heads", "kv_heads", "num_kv_heads", "n_kv_heads")
    width: tuple[str, ...] = ("hidden_size", "embed_dim", "d_model", "dim", "n_embd")
    d_v: tuple[str, ...] = ("v_head_dim", "head_dim", "head_size", "attention_head_size", "key_value_proj_dim",
                            "d_kv")
    unlocated: str = ""
    latent: Latent | None = None
    not_heads: tuple[str, ...] = ()
    rotary: bool = False
    qk_norm: tuple[str, str] | None = None
    standalone: bool = False
    dropout: tuple[str, ...] = ("attention_dropout", "attn_dropout", "dropout")
    causal_skip: bool = False
    names_sdpa: bool = False
    scale_fields: tuple[str, ...] = ("query_pre_attn_scalar",)
    multiplier_fields: tuple[str, ...] = ("attention_multiplier",)
    softcap_fields: tuple[str, ...] = ("attn_logit_softcapping",)
    set_heads: tuple[str, ...] = ("num_heads", "num_attention_heads", "n_heads", "n_head")
    set_kv_heads: tuple[str, ...] = ("num_key_value_heads", "kv_heads", "num_kv_heads", "n_kv_heads")
    set_groups: tuple[str, ...] = ("num_key_value_groups",)
    set_inner: tuple[str, ...] = ("all_head_size", "inner_dim")
    set_kv_inner: tuple[str, ...] = ()
    config_heads: tuple[str, ...] = ("num_attention_heads", "num_heads", "n_head", "n_heads",
                                     "encoder_attention_heads", "decoder_attention_heads")
    config_kv_heads: tuple[str, ...] = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
    config_d_head: tuple[str, ...] = ("head_dim",)
    config_read: bool = False
    per_head: tuple[str, ...] = ("sinks",)
    q_side: tuple[str, ...] = ("q_norm", "q_layernorm")
    kv_side: tuple[str, ...] = ("k_norm", "k_layernorm")
    after_o: tuple[str, ...] = ("LayerNorm", "layer_norm")
    refuse: str = ""


DEFAULT = Entry()

# T5's first layer holds a relative position bias per head (an Embedding of num_heads columns) that every later
# layer of the stack adds to its own scores: one layer's heads cannot change alone.
_T5 = Entry(refuse="the first layer's relative position bias has one column per head and every layer of the stack "
                   "adds it to its scores, so the head counts of a layer cannot change alone")

_MLA = ("multi-head latent attention: each head's Q, K and V are rows of up-projections (q_b_proj, kv_b_proj) "
        "reading shared latents of x (q_a_proj, kv_a_proj_with_mqa and their norms), not slices of projections of "
        "x; attn.head(i) gives those rows (a LatentHead)")

# Latent attention up-projects every query head's own K/V: the config's num_key_value_heads is not read.
_LATENT = Entry(unlocated=_MLA, kv_heads=(), latent=Latent(), refuse=_MLA)

# Attention that is exactly projections, rotary from rope_parameters and a softmax with the module's scaling.
_ROPE = Entry(rotary=True, standalone=True)
_ROPE_QK_NORM = Entry(rotary=True, qk_norm=("q_norm", "k_norm"), standalone=True)
_PLAIN = Entry(standalone=True)

#: model_type -> where its attention keeps Q/K/V and W_O (families not listed use DEFAULT); a callable gets the
#: module's config, for families whose layout depends on it.
ENTRIES: dict[str, Entry | Callable[[Any], Entry]] = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2", "qwen2_moe"), _ROPE),
    **dict.fromkeys(("qwen3", "qwen3_moe"), _ROPE_QK_NORM),
    **dict.fromkeys(("bert", "roberta"), _PLAIN),
    # Conv1D c_attn (Q | K | V columns) and c_proj; its forward splits c_attn at split_size (the heads' width).
    # Cross-attention (add_cross_attention: an EncoderDecoderModel's decoder) takes Q from q_attn, K | V from c_attn.
    "gpt2": Entry(qkv="c_attn", layout="blocks", cross_q="q_attn", set_inner=("split_size",), standalone=True),
    "phi3": Entry(qkv="qkv_proj", layout="blocks", config_read=True),
    "gpt_neox": Entry(qkv="query_key_value", layout="per_head"),
    "persimmon": Entry(qkv="query_key_value", layout="per_head"),
    "ctrl": Entry(q=("Wq",), k=("Wk",), v=("Wv",)),
    "modernbert": Entry(qkv="Wqkv", layout="blocks"),
    # Its forward splits c_attn at (embed_dim, kv_dim, kv_dim): the query and K/V widths, not the model's.
    "gpt_bigcode": lambda cfg: Entry(qkv="c_attn", layout="blocks" if cfg.multi_query else "per_head",
                                     set_inner=("split_size", "embed_dim"), set_kv_inner=("kv_dim",),
                                     width=("hidden_size",)),
    "codegen": Entry(unlocated="CodeGen's qkv_proj interleaves its heads over 4 model-parallel shards"),
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "mistral4"), _LATENT),
    "laguna": Entry(refuse="its g_proj gates each query head (one output row per head), which surgery does not resize"),
    "diffllama": Entry(refuse="differential attention subtracts pairs of heads' patterns (value heads concatenated "
                              "in pairs, lambda over the pair), so heads cannot be removed one by one"),
    **dict.fromkeys(("t5", "mt5", "umt5", "longt5", "switch_transformers", "pop2piano", "udop"), _T5),
    "dory": Entry(causal_skip=True),
    # Every model type of the modeling files that compare the implementation's name with "sdpa" (transformers 5.24).
    **dict.fromkeys(("axk2", "deepseek_v32", "dots3_note", "dots3_note_text", "dots3_note_vision_encoder",
                     "dots3_note_audio_encoder", "falcon", "gemma4", "gemma4_text", "gemma4_audio", "gemma4_vision",
                     "gemma4_unified", "gemma4_unified_text", "gemma4_unified_audio", "gemma4_unified_vision",
                     "glm5_next", "glm5_next_text", "glm5_next_vision", "glm_moe_dsa", "hy_v4", "hy_v4_vl",
                     "hy_v4_vl_text", "hy_v4_vl_vision", "minimax_m3_vl", "minimax_m3_vl_text", "minimax_m3_vl_vision",
                     "mistral_large4", "mistral_large4_text"), Entry(names_sdpa=True)),
    # Attention residuals: at every position learned queries attend over the residual stream's blocks, handing
    # over the sequence as the heads axis (no projections, no heads).
    "inkling2_text": Entry(not_heads=("Inkling2BlockAttentionResidual",)),
    "inkling2_loop_text": Entry(not_heads=("Inkling2LoopBlockAttentionResidual",
                                           "Inkling2LoopMessageAttentionResidual")),
}


def entry_for(model_type: str | None, config: Any = None) -> Entry:
    """The registry entry of ``model_type`` (a config's ``model_type``; ``config`` for layouts that depend on
    it), or :data:`DEFAULT`."""
    entry = ENTRIES.get(model_type or "", DEFAULT)
    return entry if isinstance(entry, Entry) else entry(config)


def sliding_window_of(module: Any, config: Any) -> int | None:
    """The sliding window the model's mask gives this layer, or None (full causal attention): the module's
    own ``sliding_window`` where it has one (Qwen2-style, None on full layers), else the config's, unless
    ``config.layer_types`` says this layer is not a sliding one (Mistral: every layer slides)."""
    if "sliding_window" in vars(module) or hasattr(type(module), "sliding_window"):
        window = getattr(module, "sliding_window")
    else:
        window = getattr(config, "sliding_window", None)
        types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
        if isinstance(types, (list, tuple)) and isinstance(index, int) and 0 <= index < len(types) \
                and types[index] != "sliding_attention":
            window = None
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None
