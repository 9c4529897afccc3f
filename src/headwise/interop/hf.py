"""Hugging Face interop: take over the attention of transformers models, and give it back.

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

Every other module whose forward calls transformers' attention interface is patched on the generic path
(:mod:`~headwise.interop.hf_generic`, projections located by :mod:`~headwise.interop.hf_registry`): the model's
attention implementation becomes ``"headwise"`` (:mod:`~headwise.interop.hf_interface`).

Models must use ``attn_implementation`` ``"eager"``, ``"sdpa"`` or ``"headwise"``; flash/flex attention raise
``ValueError`` before anything changes. transformers is imported only by the interop modules
(``pip install headwise[hf]``).

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
from .hf_interface import NAME

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
    from . import hf_generic

    return "; ".join([family.NAME for family, _ in _families()] + [hf_generic.NAME])


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
    from . import hf_generic

    adapters = "; ".join(family.NAME for family, _ in _families())
    if hf_generic.is_target(module):
        return TypeError(f"{what}: {name} has no family adapter (adapters: {adapters}); it is on transformers' "
                         "attention interface, so patch(model) takes it over and layers(model) gives its heads")
    return TypeError(f"{what}: {name} is not a supported attention module; supported: {adapters}")


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
    """Make, in place, every attention module of ``model`` that headwise can take over compute with headwise.

    Two paths, chosen per module (:func:`layers` with ``how=True`` says which each layer took):

    * **adapter** (BERT, GPT-2, Llama family): the module's forward is headwise's (``attn.project_qkv``, HF's
      rotary cos/sin, the model's own cache, ``attn.attend`` on HF's prepared mask, ``attn.project_out``), and
      ``attn`` is a full layer (``attn(x)`` runs alone, surgery works).
    * **interface** (every other module that calls transformers' attention interface): the module keeps its own
      forward and the model's attention implementation becomes ``"headwise"``
      (:mod:`~headwise.interop.hf_interface`), so each head is computed by headwise and reported to ``attn`` (an
      :class:`~headwise.interop.hf_generic.InterfaceView`): :func:`headwise.trace` captures and edits it.
      Projections located through :mod:`~headwise.interop.hf_registry` give ``attn.head(i)`` weight views and
      ``result`` captures; where they are not located, reading them says why.

    Nothing is replaced, copied or renamed: each module keeps its identity, parameters, buffers, submodules
    (under their Hugging Face names), hooks and attributes, and only its class changes to
    ``Headwise<Original>`` (a subclass of the original, so ``isinstance`` checks, weight init and
    ``output_attentions`` recording still work). Its ``.attn`` is a view of the module's current weights (never a
    registered submodule, so ``state_dict`` keys, ``save_pretrained``, tensor-parallel plans and PEFT targets are
    unchanged). Already patched modules are left as they are. No data is read, so a model on the meta device
    can be patched before its weights arrive.

    Everything is checked before anything changes. Returns ``model``. Raises ``TypeError`` if nothing in
    ``model`` can be patched (naming the attention classes found) and ``ValueError`` for attention
    implementations other than eager / sdpa / headwise.

    Shapes:
        per layer, as the original module: hidden_states (b, s, d) -> (b, s, d), weights (b, h, s, s_kv) or None

    Example:
        >>> import torch, transformers
        >>> cfg = transformers.AutoConfig.for_model("phi3", vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                                         num_hidden_layers=1, num_attention_heads=4, pad_token_id=0)
        >>> model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        >>> ids = torch.tensor([[1, 5, 7, 3]])
        >>> before = model(ids).logits
        >>> [(name, how) for name, attn, how in layers(patch(model), how=True)]
        [('model.layers.0.self_attn', 'interface')]
        >>> torch.testing.assert_close(model(ids).logits, before)
        >>> attn = layers(model)[0][1]
        >>> attn.head(1).w_q.data_ptr() == model.model.layers[0].self_attn.qkv_proj.weight[4:].data_ptr()
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch: model must be a torch.nn.Module, got {type(model).__name__}")
    families = _families()
    from . import hf_generic

    targets = []
    covered: set[int] = set()
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
                covered.update((id(module), id(family.host_of(module)[0])))
    modules = dict(model.named_modules())
    generic = []
    for name, module in modules.items():
        if id(module) in covered or not hf_generic.is_target(module):
            continue
        if name == "":
            raise TypeError(f"patch: {type(model).__name__} is itself an attention module; patch the model that "
                            "contains it")
        check_impl(module.config, f"patch({type(model).__name__}) at {name!r}")
        generic.append((name, module, modules[name.rpartition(".")[0]]))
    if not targets and not generic and not layers(model):
        found = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")})
        seen = (f"; it has {found}, none of them a family adapter's class and none calling transformers' attention "
                "interface in its forward (its own attention code)" if found else "")
        raise TypeError(f"patch: {type(model).__name__} contains no attention module headwise can patch; "
                        f"supported: {_supported()}{seen}")
    if generic and not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"patch: {type(model).__name__} is not a transformers PreTrainedModel, so its attention "
                        "implementation cannot be set to 'headwise'; patch the PreTrainedModel that contains it")
    views = [(module, family.from_module(module, share=True), family.host_of(module), mixin, f"adapter:{family.KEY}",
              name) for name, module, family, mixin in targets]
    views += [(module, hf_generic.from_module(module, parent, name=name), (module, ""), hf_generic.PatchedInterface,
               "interface", name) for name, module, parent in generic]
    before = _impls(model) if generic else []
    done = []
    try:
        for module, attn, (host, suffix), mixin, how, name in views:
            object.__setattr__(attn, "_hw_name", name + suffix)
            object.__setattr__(attn, "_hw_how", how)
            patch_in_place(host, attn, mixin)
            done.append(host)
        if generic:
            model.set_attn_implementation(NAME)
            stuck = sorted({type(m).__name__ for _, m, _ in generic if m.config._attn_implementation != NAME})
            if stuck:
                raise TypeError(f"patch: {type(model).__name__} did not switch {stuck} to "
                                f"attn_implementation={NAME!r} (transformers cannot set it dynamically for them)")
            model.__dict__["_hw_impls"] = before
    except BaseException:
        for host in done:
            unpatch_in_place(host)
        _restore(before)
        raise
    return model


def _impls(model: nn.Module) -> list[tuple[object, object]]:
    """Every config of ``model`` and its attention implementation, to put back on unpatch."""
    seen: dict[int, tuple[object, object]] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen and hasattr(config, "_attn_implementation_internal"):
            seen[id(config)] = (config, config._attn_implementation_internal)
    return list(seen.values())


def _restore(impls: list[tuple[object, object]]) -> None:
    for config, impl in impls:
        config._attn_implementation_internal = impl


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: every patched module gets its original class back, the model its attention
    implementation, and ``model`` is returned.

    The weights never moved, so nothing is copied; edits made through ``.attn`` or its heads while patched
    are edits of the model's own weights. A model without patched modules is returned unchanged.

    Shapes:
        no tensor is touched
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"unpatch: model must be a torch.nn.Module, got {type(model).__name__}")
    for module in [m for m in model.modules() if isinstance(m, HeadwiseHFModule)]:
        unpatch_in_place(module)
    _restore(model.__dict__.pop("_hw_impls", []))
    return model


def layers(model: nn.Module, *, how: bool = False) -> list[tuple]:
    """``(qualified name of the patched module, its MultiHeadAttention)`` for every patched layer, in model
    order (empty if ``model`` is not patched). Each layer's ``repr`` names the module it is a view of.
    ``how=True`` adds which path :func:`patch` took: ``"adapter:bert"``, ``"adapter:gpt2"``,
    ``"adapter:llama"`` or ``"interface"``.

    Shapes:
        each layer: MultiHeadAttention(d, h, h_kv, d_h); ``attn.head(i)`` gives head i's (d, d_h) weights

    Example:
        >>> import transformers
        >>> cfg = transformers.BertConfig(hidden_size=12, num_attention_heads=3, num_hidden_layers=2,
        ...                               intermediate_size=8, vocab_size=10)
        >>> [name for name, attn in layers(patch(transformers.BertModel(cfg)))]
        ['encoder.layer.0.attention.self', 'encoder.layer.1.attention.self']
    """
    found = [(name, module.attn) for name, module in model.named_modules() if isinstance(module, HeadwiseHFModule)]
    return [(name, attn, attn.__dict__.get("_hw_how", "adapter")) for name, attn in found] if how else found
