"""Hugging Face interop: take over the attention of BERT, GPT-2 and Llama-family models, and give it back.

* :func:`from_hf` / :func:`to_hf`: one HF attention module <-> one :class:`MultiHeadAttention` (copies).
* :func:`patch` / :func:`unpatch`: make every supported attention module of a model compute with headwise, in
  place (same objects, same parameters under the same names; only the class changes), and back;
  :func:`layers` lists the headwise layers, each a live view of its module's weights.

Supported modules (the per-family name maps are in :mod:`~headwise.interop.hf_bert`,
:mod:`~headwise.interop.hf_gpt2`, :mod:`~headwise.interop.hf_llama`):

* BERT: ``BertAttention`` (``.self.query/key/value`` + ``.output.dense`` as W_O); not ``BertCrossAttention``.
* GPT-2: ``GPT2Attention`` (``Conv1D`` weights, stored (in, out)); not its cross-attention variant.
* Llama family: ``LlamaAttention``, ``MistralAttention``, ``Qwen2Attention``, ``Qwen3Attention`` (GQA/MQA,
  explicit ``head_dim``, biases, rotary from ``rope_parameters``, Qwen3's per-head Q/K RMSNorm; sliding-window
  layers work because HF's masks carry the window).

Models must use ``attn_implementation`` ``"eager"`` or ``"sdpa"``; flash/flex attention raise ``ValueError``
before anything changes. transformers
is imported only here and in the family modules (``pip install headwise[hf]``).

Shapes:
    b: batch, s: sequence, h: query heads, h_kv: key/value heads, d: model width, d_h: head width.

Example:
    >>> import torch, transformers
    >>> from headwise.interop import patch, unpatch, layers
    >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...                                num_attention_heads=4, num_key_value_heads=2)
    >>> model = transformers.LlamaForCausalLM(cfg).eval()
    >>> ids = torch.tensor([[1, 5, 7, 3]])
    >>> before = model(ids).logits
    >>> keys = list(model.state_dict())
    >>> _ = patch(model)
    >>> [name for name, attn in layers(model)]
    ['model.layers.0.self_attn', 'model.layers.1.self_attn']
    >>> torch.testing.assert_close(model(ids).logits, before)
    >>> list(model.state_dict()) == keys                              # nothing renamed, nothing added
    True
    >>> head = model.model.layers[0].self_attn.attn.head(3)           # a real head object of the real model
    >>> head.kv_index, head.w_q.data_ptr() == model.model.layers[0].self_attn.q_proj.weight[12:].data_ptr()
    (1, True)
    >>> type(unpatch(model).model.layers[0].self_attn).__name__
    'LlamaAttention'
"""

from __future__ import annotations

import copy
from types import ModuleType

from torch import nn

from ..attention import MultiHeadAttention
from ._hf_common import HeadwiseHFModule, check_impl, patch_in_place, unpatch_in_place

__all__ = ["from_hf", "to_hf", "patch", "unpatch", "layers", "HeadwiseHFModule"]


def _families() -> list[tuple[ModuleType, type]]:
    try:
        import transformers  # noqa: F401
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("headwise.interop.hf needs transformers: pip install 'headwise[hf]'") from e
    from . import hf_bert, hf_gpt2, hf_llama

    return [(hf_bert, hf_bert.PatchedBertSelf), (hf_gpt2, hf_gpt2.PatchedGPT2),
            (hf_llama, hf_llama.PatchedLlamaStyle)]


def _supported() -> str:
    return "; ".join(family.NAME for family, _ in _families())


def _family_of(module: object) -> tuple[ModuleType, type] | None:
    if isinstance(module, HeadwiseHFModule):
        return None
    for family, mixin in _families():
        if isinstance(module, family.classes()):
            return family, mixin
    return None


def _unsupported(module: object, what: str) -> Exception:
    name = type(module).__name__
    if isinstance(module, HeadwiseHFModule):
        return TypeError(f"{what}: {name} is already patched by headwise; use its .attn (a MultiHeadAttention) "
                         "or unpatch the model first")
    from . import hf_bert

    self_cls, cross_cls = hf_bert.self_attention_classes()
    if isinstance(module, (self_cls, cross_cls)):
        return TypeError(f"{what}: {name} holds only W_Q, W_K, W_V (W_O is the sibling BertSelfOutput.dense); "
                         "pass the enclosing BertAttention (e.g. model.encoder.layer[0].attention)")
    return TypeError(f"{what}: {name} is not a supported attention module; supported: {_supported()}")


def from_hf(module: nn.Module, *, rotary_emb: nn.Module | None = None) -> MultiHeadAttention:
    """A :class:`MultiHeadAttention` with a copy of one Hugging Face attention module's weights.

    Every weight's shape is checked against the module's config. For Llama-family modules the layer gets
    a :class:`~headwise.RotaryEmbedding` built from ``module.config.rope_parameters`` (pass the model's
    ``rotary_emb`` module to copy its frequencies exactly for non-default rope types).

    Shapes:
        BertAttention / GPT2Attention (d, h) -> MultiHeadAttention(d, h); LlamaAttention (d, h, h_kv, d_h)
        -> MultiHeadAttention(d, h, h_kv, d_head=d_h, rotary=...)

    Example:
        >>> import torch, transformers
        >>> cfg = transformers.GPT2Config(n_embd=12, n_head=3, n_layer=1)
        >>> block = transformers.GPT2Model(cfg).h[0].attn
        >>> attn = from_hf(block)
        >>> x = torch.randn(1, 4, 12)
        >>> torch.testing.assert_close(attn.q_proj(x), x @ block.c_attn.weight[:, :12] + block.c_attn.bias[:12])
    """
    family = _family_of(module)
    if family is None:
        raise _unsupported(module, "from_hf")
    return family[0].from_module(module, share=False, rotary_emb=rotary_emb)


def to_hf(attn: MultiHeadAttention, like: nn.Module) -> nn.Module:
    """A new Hugging Face module of ``like``'s class and config holding ``attn``'s weights.

    ``like`` is deep-copied (parts outside the attention, such as ``BertSelfOutput.LayerNorm``, keep
    ``like``'s values) and every weight is written after a shape check; a layer of another shape, head
    grouping, bias layout or scale raises ``ValueError``. ``to_hf(from_hf(m), like=m)`` reproduces ``m``'s
    weights exactly.

    Shapes:
        attn: MultiHeadAttention matching like (d, h, h_kv, d_h) -> module of type(like)

    Example:
        >>> import torch, transformers
        >>> cfg = transformers.BertConfig(hidden_size=12, num_attention_heads=3, num_hidden_layers=1,
        ...                               intermediate_size=8, vocab_size=10)
        >>> block = transformers.BertModel(cfg).encoder.layer[0].attention
        >>> again = to_hf(from_hf(block), like=block)
        >>> all(torch.equal(a, b) for a, b in zip(block.state_dict().values(), again.state_dict().values()))
        True
    """
    if not isinstance(attn, MultiHeadAttention):
        raise TypeError(f"to_hf: attn must be a MultiHeadAttention, got {type(attn).__name__}")
    family = _family_of(like)
    if family is None:
        raise _unsupported(like, "to_hf")
    family[0].config_of(like)  # validate like before paying for the copy
    new = copy.deepcopy(like)
    family[0].load_into(new, attn)
    return new


def patch(model: nn.Module) -> nn.Module:
    """Make, in place, every supported attention module of ``model`` compute its attention with headwise.

    Nothing is replaced, copied or renamed: each module keeps its identity, parameters, buffers, submodules
    (under their Hugging Face names), hooks and attributes, and only its class changes to
    ``Headwise<Original>`` (a subclass of the original, so ``isinstance`` checks, weight init and
    ``output_attentions`` recording still work). Its ``.attn`` is a :class:`MultiHeadAttention` that is a
    *view* of the module's current weights (never a registered submodule, so ``state_dict`` keys,
    ``save_pretrained``, tensor-parallel plans and PEFT targets are unchanged) and its forward computes with
    it: ``attn.project_qkv``, HF's rotary cos/sin (equal to ``attn.rotary``), the model's own cache via
    ``cache.update(k, v, layer_idx)``, ``attn.attend`` on HF's prepared mask, ``attn.project_out``.
    Already patched modules are left as they are; cross-attention modules are not patched. No data is read,
    so a model on the meta device can be patched before its weights arrive.

    Everything is checked before anything changes. Returns ``model``. Raises ``TypeError`` if nothing in
    ``model`` can be patched (naming the attention classes found) and ``ValueError`` for attention
    implementations other than eager / sdpa.

    Shapes:
        per layer, as the original module: hidden_states (b, s, d) -> (b, s, d), weights (b, h, s, s_kv) or None
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch: model must be a torch.nn.Module, got {type(model).__name__}")
    families = _families()
    targets = []
    for name, module in model.named_modules():
        if isinstance(module, HeadwiseHFModule):
            continue
        for family, mixin in families:
            if family.is_target(module):
                if name == "":
                    raise TypeError(f"patch: {type(model).__name__} is itself an attention module; patch the "
                                    "model that contains it, or convert it with from_hf")
                config = module.self.config if hasattr(module, "self") else module.config
                check_impl(config, f"patch({type(model).__name__}) at {name!r}")
                targets.append((name, module, family, mixin))
    if not targets and not layers(model):
        found = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")})
        seen = f"; it has {found}, none of them a supported class" if found else ""
        raise TypeError(f"patch: {type(model).__name__} contains no attention module headwise can patch; "
                        f"supported: {_supported()}{seen}")
    views = [(module, family.from_module(module, share=True), family, mixin) for _, module, family, mixin in targets]
    for (name, *_), (module, attn, family, mixin) in zip(targets, views):
        host, suffix = family.host_of(module)
        object.__setattr__(attn, "_hw_name", name + suffix)
        patch_in_place(host, attn, mixin)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: every patched module gets its original class back and returns ``model``.

    The weights never moved, so nothing is copied; edits made through ``.attn`` or its heads while patched
    are edits of the model's own weights. A model without patched modules is returned unchanged.

    Shapes:
        no tensor is touched
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"unpatch: model must be a torch.nn.Module, got {type(model).__name__}")
    for module in [m for m in model.modules() if isinstance(m, HeadwiseHFModule)]:
        unpatch_in_place(module)
    return model


def layers(model: nn.Module) -> list[tuple[str, MultiHeadAttention]]:
    """``(qualified name of the patched module, its MultiHeadAttention)`` for every patched layer, in model
    order (empty if ``model`` is not patched). Each layer's ``repr`` names the module it is a view of.

    Shapes:
        each layer: MultiHeadAttention(d, h, h_kv, d_h); ``attn.head(i)`` gives head i's (d, d_h) weights

    Example:
        >>> import transformers
        >>> cfg = transformers.BertConfig(hidden_size=12, num_attention_heads=3, num_hidden_layers=2,
        ...                               intermediate_size=8, vocab_size=10)
        >>> [name for name, attn in layers(patch(transformers.BertModel(cfg)))]
        ['encoder.layer.0.attention.self', 'encoder.layer.1.attention.self']
    """
    return [(name, module.attn) for name, module in model.named_modules() if isinstance(module, HeadwiseHFModule)]
